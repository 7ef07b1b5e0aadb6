"""The experiments behind evidence/: one-off benchmarks run from a checkout, `python -m benchmarks NAME`.

They answer a design question once (which KV layout, what a tick of K rows costs, whether speculation
pays) and keep the script that wrote each figure; the harnesses an operator runs stay in `meshnode bench`
(meshnode/bench). Same flags, same output conventions (ratios side by side, llama_print_system_info).
"""

EXPERIMENTS = {
    "engine": "decode tok/s at batch 1/2/4/8 in-process vs llama-cpp-python's Llama.generate",
    "soak": "mixed load, random cancels and engine kills; nothing may be lost",
    "restart": "SIGKILL of the engine to the first token from the restarted engine",
    "samples": "a tick's sampled ids back from the engine: through the arena vs inside the msgpack answer",
    "ipc": "round trip of the engine link (SEQPACKET) vs a zmq PAIR on ipc:// (diagnostic)",
    "abuse": "4 streams' worst token gap while the largest valid requests of every kind arrive vs steady",
    "layout": "deterministic mode vs not (and unified KV): mix, decode, burst, chat, a lone session",
    "sampling": "a batch-8 decode tick, greedy vs every sampling option and logprobs on",
    "chat": "8 users x 6 turns re-sending their history: prefix cache on vs off (vs llama-server)",
    "ticks": "what a tick costs by shape (chunk sizes around the attention tile, deep, beside decode rows)",
    "rpc": "the model split over 1 and 2 ggml RPC workers vs local, and behind 0.2-5 ms of round trip",
    "embed": "/v1/embeddings through the node's gateway vs llama-server --embedding: cosine per input, time",
    "kvroute": "K/V cache types: a lone row's bits unpadded, its speed by depth, prefill, perplexity vs f16/f16",
    "rows": "what a tick of one sequence's 1-48 rows costs (the price of K drafts), deterministic and not",
    "spec": "one session alone, code-edit and chat: speculative decoding auto vs off (deterministic and not) vs "
            "llama-server's ngram-simple and ngram-mod; 8 at once, auto vs off",
    "priority": "two priorities under overload: the high class's first token vs an idle node's, priority vs fcfs",
    "toolcalls": "tool_choice required within max_tokens 64 on the real model: answers holding a whole valid call",
    "llamatests": "llama.cpp's own server tests against llama-server and against the node's gateway: the pass table",
    "moves": "a session moved to another node with its KV vs prefilled again there, by context length (1k-8k)",
    "hostile": "hostile KV state files and frames against a node beside another client's session (issue 66's goals)",
    "templates": "a model file's hostile chat templates beside a stream, a pinger and honest chats: pings, gaps",
    "kernels": "decode at 1-16 sessions, llama-batched-bench from stock llama.cpp vs patches/, and one MUL_MAT's cost",
    "toolflood": "50 tool_choice required calls at once through the gateway beside a ZeroMQ stream: its gaps",
    "dynamo": "8 users x 6 turns through Dynamo's frontend over two nodes (kv, round-robin, a node killed) vs one node",
    "structured": "a decode tick with 0, 1 and 8 JSON-schema rows at batch 1 and 8 (vs llama-server's json_schema)",
}
