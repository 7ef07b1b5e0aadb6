"""An OpenAI-compatible HTTP face for a node: a client of the front over ZeroMQ, as vLLM's API server is
a client of its engine core. `api.py` translates (pure), `upstream.py` speaks the node's protocol,
`server.py` serves HTTP (aiohttp)."""
