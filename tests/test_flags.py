"""Every flag a user can give reaches what it promises: one check each, failing when the flag is dropped or
ignored on its way (parsed is not done)."""
import json
import subprocess
import sys

import httpx

from helpers import curve_keys, serve, wait_until
from ipc.transport import free_tcp_port
from meshnode.core import reasons as R
from meshnode.core.types import Sampling
from meshnode.dev.nodeproc import NodeProcess

PROMPT = [5 + k * 37 % 400 for k in range(40)]
LONG = [5 + k * 29 % 500 for k in range(200)]  # long enough that deterministic mode reuses part of it


def test_generate_reads_messages_stops_at_a_stop_string_and_prints_logprobs(tiny_model, tmp_path):
    """`meshnode generate --messages F --stop S --logprobs 2`: the node's answer for the same request, cut
    before the stop string, and one logprob line per token."""
    msgs = [{"role": "user", "content": "tell me about meshes"}]
    f = tmp_path / "messages.json"
    f.write_text(json.dumps(msgs))
    with NodeProcess(tiny_model) as n, n.client() as c:
        free = c.generate("free", messages=msgs, max_tokens=30, ignore_eos=True)
        stop = free.done["text"][10:13]
        want = c.generate("want", messages=msgs, max_tokens=30, ignore_eos=True, stop=[stop], logprobs=2)
        out = subprocess.run([sys.executable, "-m", "meshnode", "generate", "--connect", n.listen, "--messages",
                              str(f), "--stop", stop, "--logprobs", "2", "--max-tokens", "30", "--ignore-eos"],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert want.done["reason"] == R.STOP and stop not in want.done["text"]
    assert out.stdout.strip() == want.done["text"].strip()
    lines = [ln for ln in out.stderr.splitlines() if ln.strip().startswith("[") and "|" in ln]
    assert len(lines) == len(want.tokens) and f"[{R.STOP}]" in out.stderr


def test_prefix_cache_node_shares_a_prompt_across_clients_and_off_reuses_nothing(tiny_model):
    def second_hit(scope: str, same_client: bool) -> int:
        with NodeProcess(tiny_model, "--prefix-cache", scope) as n, n.client() as a, n.client() as b:
            a.generate("first", tokens=LONG, max_tokens=4, ignore_eos=True)
            again = (a if same_client else b).generate("second", tokens=LONG + PROMPT[:10], max_tokens=4,
                                                       ignore_eos=True)
            assert a.status()["node"]["prefix_cache"] == scope
            return again.done["usage"]["cached_tokens"]

    assert second_hit("node", same_client=False) > 0  # another client's conversation, shared by `node`
    assert second_hit("client", same_client=False) == 0  # the default: its own only
    assert second_hit("client", same_client=True) > 0
    assert second_hit("off", same_client=True) == 0  # not even its own


def test_chat_special_in_content_parses_markers_in_a_messages_content(tiny_model):
    """The tiny vocab has `</s>` (its EOS) as a special token: with the flag, content that spells it becomes
    that one token (llama-server's way); by default it is text, several tokens."""
    msgs = [{"role": "user", "content": "hi </s> there"}]

    def prompt_tokens(*flags) -> int:
        with NodeProcess(tiny_model, *flags) as n, n.client() as c:
            return c.generate("m", messages=msgs, max_tokens=1).done["usage"]["prompt_tokens"]

    assert prompt_tokens("--chat-special-in-content") < prompt_tokens()


def test_scheduling_and_connection_flags_reach_the_node(tiny_model):
    with NodeProcess(tiny_model, "--tick-target-ratio", "3", "--gather-ms", "7", "--max-clients-per-host", "5") as n, \
            n.client() as c:
        st = c.status()
    assert st["capacity"]["tick_target_ratio"] == 3.0 and st["capacity"]["tick_target_ms"] is None
    assert st["node"]["gather_ms"] == 7.0 and st["node"]["max_clients_per_host"] == 5
    with NodeProcess(tiny_model, "--tick-target-ms", "40") as n, n.client() as c:
        cap = c.status()["capacity"]
    assert cap["tick_target_ms"] == 40.0 and cap["tick_target_ratio"] is None


def test_a_standalone_gateway_reaches_a_curve_node_and_serves_its_metrics_and_model_vocab(tiny_model, tmp_path):
    """`meshnode gateway --curve-server-key --curve-client-cert --metrics-from --model`: the answer is the
    node's, /metrics is the node's text, and logprobs name tokens from the --model vocabulary (the node's own
    path is gone once it loaded: without --model the gateway could not name them and would answer 400)."""
    import os
    import shutil

    import zmq.auth

    served, moved = str(tmp_path / "served.gguf"), str(tmp_path / "moved.gguf")
    shutil.copy(tiny_model, served)

    allowed, server_public, server_secret, secrets = curve_keys(tmp_path, "gateway")
    server_pub, _ = zmq.auth.load_certificate(server_secret)
    port, http, metrics = free_tcp_port(), free_tcp_port(), free_tcp_port()
    known = {"server_public_key": server_pub, "client_cert": zmq.auth.load_certificate(secrets["gateway"])}
    with NodeProcess(served, "--curve-secret-key", server_secret, "--curve-allow-dir", str(allowed),
                     "--metrics-listen", f"127.0.0.1:{metrics}", listen=f"tcp://127.0.0.1:{port}",
                     client_kw=known) as n, n.client() as c:
        os.rename(served, moved)
        gw = subprocess.Popen([sys.executable, "-m", "meshnode", "gateway", "--listen", f"127.0.0.1:{http}",
                               "--node", n.listen, "--curve-server-key", server_public, "--curve-client-cert",
                               secrets["gateway"], "--metrics-from", f"http://127.0.0.1:{metrics}/metrics",
                               "--model", moved], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{http}"

            def up():
                try:
                    return httpx.get(f"{base}/health", timeout=2).status_code == 200
                except httpx.HTTPError:
                    return False

            assert wait_until(up, timeout_s=120, every_s=0.2), "the gateway never reached the CURVE node"
            body = {"prompt": PROMPT[:6], "max_tokens": 8, "temperature": 0.8, "seed": 3, "logprobs": 2}
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            r = r.json()
            ref = c.generate("ref", tokens=PROMPT[:6], max_tokens=8, sampling=Sampling(0.8, 0, 1.0, 3, logprobs=2))
            scraped = httpx.get(f"{base}/metrics", timeout=10).text
        finally:
            gw.terminate()
            gw.wait(30)
    assert r["choices"][0]["text"] == ref.done["text"]
    assert len(r["choices"][0]["logprobs"]["tokens"]) == len(ref.tokens)  # named: the vocab came from --model
    assert "meshnode_requests_running" in scraped


def test_spec_flags_reach_the_engine_and_status_says_what_runs(tiny_model, tmp_path):
    """--spec lookup --draft-max 3 on a flat model (every greedy token the same: every draft right): drafts
    of 3 tokens, so most tokens come from them; on the unified layout the mode is off and status says why;
    --spec draft without a draft model, or a draft model of another vocab, is refused at start in one line."""
    from meshnode.ops.models import make_model

    flat = str(make_model(tmp_path / "flat.gguf", "tiny", 0, flat=True))
    with NodeProcess(flat, "--spec", "lookup", "--draft-max", "3") as n, n.client() as c:
        r = c.generate("x", tokens=PROMPT, max_tokens=41, ignore_eos=True)
        node, engine = c.status()["node"], c.status()["telemetry"]["engine"]
    assert (node["spec"], node["spec_problem"], node["draft_max"]) == ("lookup", "", 3)
    assert len(r.tokens) == 41 and engine["drafts_served_total"] >= 25, engine  # 3 of every 4 from drafts
    assert engine["drafted_rows_total"] <= 3 * 14, engine
    with NodeProcess(flat, "--kv-layout", "unified", "--no-deterministic") as n, n.client() as c:
        node = c.status()["node"]
    assert node["spec"] == "off" and node["spec_problem"].startswith("spec: off on the unified KV layout")
    out = serve(flat, "--spec", "draft", "--listen", f"ipc://{tmp_path}/a.sock")
    assert out.returncode == 2 and "spec: draft needs a draft model" in out.stderr, out.stderr
    other = str(make_model(tmp_path / "bpe.gguf", "tiny-bpe", 0))
    out = serve(flat, "--draft-model", other, "--listen", f"ipc://{tmp_path}/b.sock",
                "--telemetry", f"ipc://{tmp_path}/t.sock")
    lines = [ln for ln in out.stderr.splitlines() if "cannot draft for this model" in ln]
    assert out.returncode == 2 and len(lines) == 1 and "token 0 is" in lines[0], out.stderr
