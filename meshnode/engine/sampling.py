"""Per-session sampling with a counter-based random stream.

llama.cpp's sampler chains are stateful: their draws depend on how many tokens
were sampled before, so a session re-prefilled into a restarted engine, or one
batched with different neighbours, could diverge. Here the uniform number for a
session's i-th generated token is a pure function of (seed, i) (SplitMix64), so
the output depends only on the logits and on (seed, i).
"""
from __future__ import annotations

import numpy as np

from meshnode.core.types import Sampling

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def uniform(seed: int, i: int) -> float:
    """A uniform float in [0, 1) for draw `i` of stream `seed`."""
    return (_splitmix64(_splitmix64(seed & _MASK) ^ (i & _MASK)) >> 11) / float(1 << 53)


def sample(logits: np.ndarray, sampling: Sampling, draw: int) -> int:
    """Pick a token from one row of logits: argmax when greedy, else temp/top-k/top-p."""
    if sampling.greedy:
        return int(np.argmax(logits))
    z = logits.astype(np.float64)
    with np.errstate(over="ignore"):  # a tiny temperature sends all but the best to -inf: its limit
        z = (z - z.max()) / sampling.temperature  # max first: logits / 5e-324 would be inf - inf = nan
    order = np.argsort(-z, kind="stable")  # ties broken by token id: deterministic
    if 0 < sampling.top_k < len(order):
        order = order[: sampling.top_k]
    z = z[order]
    p = np.exp(z)
    p /= p.sum()
    if sampling.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), sampling.top_p) + 1)
        p = p[:keep] / p[:keep].sum()
        order = order[:keep]
    u = uniform(sampling.seed, draw)
    idx = int(np.searchsorted(np.cumsum(p), u, side="right"))
    return int(order[min(idx, len(order) - 1)])
