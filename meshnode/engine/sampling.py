"""Per-session sampling with a counter-based random stream.

llama.cpp's sampler chains are stateful: their draws depend on how many tokens
were sampled before, so a session re-prefilled into a restarted engine, or one
batched with different neighbours, could diverge. Here the uniform number for a
session's i-th generated token is a pure function of (seed, i) (SplitMix64), so
the output depends only on the logits and on (seed, i).
"""
from __future__ import annotations

import numpy as np

from meshnode.core.types import Logprob, Sampling

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def logprobs(logits: np.ndarray, token: int, n: int) -> Logprob:
    """The token's log-probability under the raw logits (log-softmax), and the n most likely tokens'."""
    z = logits.astype(np.float64)
    lp = z - z.max()
    lp -= np.log(np.exp(lp).sum())
    top = _best(lp, np.arange(len(lp)), n)
    return Logprob(float(lp[token]), tuple((int(t), float(lp[t])) for t in top))


def _best(z: np.ndarray, cand: np.ndarray, k: int) -> np.ndarray:
    """The candidates by descending z (ties by token id), only the best k when 0 < k: a partial
    selection first, so a 32k vocabulary is not sorted whole for a top-40."""
    if 0 < k < len(cand):
        cand = np.sort(cand[np.argpartition(-z[cand], k - 1)[:k]])
    return cand[np.argsort(-z[cand], kind="stable")]


def uniform(seed: int, i: int) -> float:
    """A uniform float in [0, 1) for draw `i` of stream `seed`."""
    return (_splitmix64(_splitmix64(seed & _MASK) ^ (i & _MASK)) >> 11) / float(1 << 53)


def penalize(logits: np.ndarray, window, s: Sampling) -> np.ndarray:
    """llama.cpp's repetition penalties over the last `repeat_last_n` tokens of the sequence: a seen
    token's logit is divided by `repeat_penalty` (multiplied when negative), then lowered by
    `presence_penalty` once and `frequency_penalty` per occurrence."""
    z = np.array(logits, dtype=np.float32)
    toks, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    if not len(toks):
        return z
    v = z[toks]
    if s.repeat_penalty != 1.0:
        v = np.where(v > 0, v / s.repeat_penalty, v * s.repeat_penalty)
    z[toks] = v - (counts * s.frequency_penalty + s.presence_penalty)
    return z


def sample(logits: np.ndarray, sampling: Sampling, draw: int, history=()) -> int:
    """Pick a token from one row of logits: penalties first (over `history`, the sequence's tokens so
    far), then argmax when greedy, else min-p, temperature, top-k, top-p and the draw. A token at -inf
    (forbidden by a response_format) is never drawn.

    Only truncation needs the tokens in order of probability: with neither top-k nor top-p the draw walks
    the candidates in id order (the same distribution without sorting the vocabulary, 3 ms a row at 32k
    tokens); top-p alone sorts only the most likely tokens that carry its mass."""
    if sampling.penalized:
        logits = penalize(logits, history[-sampling.repeat_last_n:], sampling)
    if sampling.greedy:
        return int(np.argmax(logits))
    z = logits.astype(np.float64)
    finite = np.isfinite(z)
    cand = np.arange(len(z)) if finite.all() else np.flatnonzero(finite)
    best = z[cand].max()
    if sampling.min_p > 0.0:  # keep tokens at least min_p times as likely as the best (before temperature)
        cand = cand[z[cand] >= best + np.log(sampling.min_p)]
    with np.errstate(over="ignore"):  # a tiny temperature sends all but the best to -inf: its limit
        z = (z - best) / sampling.temperature  # max first: logits / 5e-324 would be inf - inf = nan
    u = uniform(sampling.seed, draw)
    if sampling.top_k == 0 and sampling.top_p >= 1.0:
        c = np.cumsum(np.exp(z[cand]))
        return int(cand[min(int(np.searchsorted(c, u * c[-1], side="right")), len(cand) - 1)])
    if sampling.top_k:
        order = _best(z, cand, sampling.top_k)  # ties broken by token id: deterministic
        p = np.exp(z[order])
        p /= p.sum()
    else:
        order, p = _nucleus(z, cand, sampling.top_p)
    if sampling.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), sampling.top_p) + 1)
        p = p[:keep] / p[:keep].sum()
        order = order[:keep]
    idx = int(np.searchsorted(np.cumsum(p), u, side="right"))
    return int(order[min(idx, len(order) - 1)])


def _nucleus(z: np.ndarray, cand: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The most likely candidates, best first, enough of them to hold `top_p` of the mass, and their
    probabilities over all candidates: 64, then 4 times as many, until they do."""
    q = np.exp(z[cand])
    need = top_p * q.sum()
    k = 64
    while k < len(cand) and np.partition(q, len(q) - k)[len(q) - k:].sum() < need:
        k *= 4
    order = _best(z, cand, min(k, len(cand)))
    return order, np.exp(z[order]) / q.sum()
