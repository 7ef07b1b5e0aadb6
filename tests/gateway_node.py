"""Helpers of the gateway tests (test_gateway.py, test_gateway_edges.py; their `served` node is conftest.py's)."""
import httpx

from helpers import wait_until


def gateway_up(base: str, headers=None) -> None:
    """Until the gateway child answers /health (it starts once the node serves)."""
    def ok():
        try:
            return httpx.get(f"{base}/health", headers=headers, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
    assert wait_until(ok, timeout_s=120, every_s=0.2), "the gateway never became healthy"


def auth():
    return {"Authorization": "Bearer sk-test-1"}
