"""A pure-numpy, KV-cached dense Llama: the oracle for the llama.cpp engine.

It reads the SAME GGUF with the gguf package and implements the same `step`
contract, but shares no code with llama.cpp. When its logits match llama.cpp's
at many positions, for single and batched sequences, that independently proves
positions, RoPE, grouped-query attention and sequence isolation are right.
Each sequence is computed on its own, so batching cannot leak between them.
Only unquantized (f32 / f16) tensors are supported: the demo models are.
"""
from __future__ import annotations

import numpy as np

from meshnode.core.types import Plan, StepResult
from meshnode.engine.base import Engine


class ReferenceEngine(Engine):
    def __init__(self, model_path: str, n_seq_max: int = 8, n_ctx_seq: int | None = None, n_batch: int = 512):
        from gguf import GGUFReader

        r = GGUFReader(model_path)

        def meta(key):
            return r.fields[key].contents()

        self.n_layer = int(meta("llama.block_count"))
        self.n_head = int(meta("llama.attention.head_count"))
        self.n_head_kv = int(meta("llama.attention.head_count_kv"))
        self.eps = float(meta("llama.attention.layer_norm_rms_epsilon"))
        self.rope_base = float(meta("llama.rope.freq_base"))
        self.w = {t.name: np.asarray(t.data, dtype=np.float32) for t in r.tensors}
        self.n_vocab, n_embd = self.w["token_embd.weight"].shape
        self.head_dim = n_embd // self.n_head
        self.n_seq_max, self.n_batch = n_seq_max, n_batch
        self.n_ctx_seq = n_ctx_seq or int(meta("llama.context_length"))
        self.eos = int(meta("tokenizer.ggml.eos_token_id"))
        self._kv: dict[int, list] = {}
        self._init_sequences()

    def _run(self, plan: Plan) -> StepResult:
        res = StepResult()
        for c, (_, logits) in self._compute(plan):
            self.sample(c, logits, res)
        return res

    def logits_for(self, plan: Plan) -> dict[int, np.ndarray]:
        self.begin(plan)
        out = {sid: logits for _, (sid, logits) in self._compute(plan)}
        self.end(plan, StepResult())
        return out

    def _compute(self, plan: Plan):
        """(chunk, (seq, last row's logits)) for each chunk that asks for a sample; every chunk runs."""
        out = []
        for c in plan.chunks:
            logits = self._forward(c.seq_id, np.asarray(c.tokens), c.pos)
            if c.draw >= 0:
                out.append((c, (c.seq_id, logits)))
        return out

    def release_kv(self, seq_id: int) -> None:
        self._kv.pop(seq_id, None)

    def trim_kv(self, seq_id: int, n: int) -> None:
        for layer in self._kv.get(seq_id, []):
            layer[0], layer[1] = layer[0][:n], layer[1][:n]

    def share_kv(self, src: int, dst: int, n: int) -> None:
        self._kv[dst] = [[k[:n].copy(), v[:n].copy()] for k, v in self._kv[src]]

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """llama.cpp's NORM rope: rotate adjacent pairs (x[2i], x[2i+1])."""
        half = self.head_dim // 2
        inv = self.rope_base ** (-np.arange(half, dtype=np.float64) * 2 / self.head_dim)
        ang = pos[:, None].astype(np.float64) * inv[None, :]  # (n, half)
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    def _norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def _forward(self, seq: int, tokens: np.ndarray, pos0: int) -> np.ndarray:
        """Run `tokens` at positions pos0.. through the model; return the last row's logits."""
        w, n, hd = self.w, len(tokens), self.head_dim
        pos = np.arange(pos0, pos0 + n)
        cache = self._kv.setdefault(seq, [[np.zeros((0, self.n_head_kv, hd), np.float32)] * 2
                                          for _ in range(self.n_layer)])
        x = w["token_embd.weight"][tokens].astype(np.float32)
        group = self.n_head // self.n_head_kv
        for i in range(self.n_layer):
            b = f"blk.{i}."
            h = self._norm(x, w[b + "attn_norm.weight"])
            q = self._rope((h @ w[b + "attn_q.weight"].T).reshape(n, self.n_head, hd), pos)
            k = self._rope((h @ w[b + "attn_k.weight"].T).reshape(n, self.n_head_kv, hd), pos)
            v = (h @ w[b + "attn_v.weight"].T).reshape(n, self.n_head_kv, hd)
            cache[i][0] = K = np.concatenate([cache[i][0], k.astype(np.float32)])
            cache[i][1] = V = np.concatenate([cache[i][1], v])
            Kh, Vh = np.repeat(K, group, axis=1), np.repeat(V, group, axis=1)  # GQA: head h -> kv h//group
            scores = np.einsum("qhd,khd->hqk", q, Kh) / np.sqrt(hd)
            mask = np.arange(len(K))[None, :] > pos[:, None]  # causal: keys at positions <= query
            scores = np.where(mask[None], -np.inf, scores)
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            scores /= scores.sum(axis=-1, keepdims=True)
            att = np.einsum("hqk,khd->qhd", scores, Vh).reshape(n, self.n_head * hd)
            x = x + att @ w[b + "attn_output.weight"].T
            h = self._norm(x, w[b + "ffn_norm.weight"])
            g = h @ w[b + "ffn_gate.weight"].T
            x = x + ((g / (1 + np.exp(-g))) * (h @ w[b + "ffn_up.weight"].T)) @ w[b + "ffn_down.weight"].T
        x = self._norm(x[-1:], w["output_norm.weight"])
        return (x @ w["output.weight"].T)[0].astype(np.float32)
