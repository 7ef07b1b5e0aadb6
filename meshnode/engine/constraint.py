"""One session's output constraint in the engine process, where its tokens are sampled.

An llguidance matcher (grammar compiled by the front, meshnode/text/constraints.py) says which tokens may
come next; the disallowed ones' logits become -inf before sampling, so greedy and seeded draws alike pick
an allowed token, and logprobs describe the constrained distribution. Each sampled token advances the
matcher; a restarted engine rebuilds it by replaying the tokens generated so far.
"""
from __future__ import annotations

import numpy as np


class Constraint:
    def __init__(self, tokenizer, grammar: str, n_vocab: int, n_prompt: int = 0):
        import llguidance as G
        import llguidance.numpy as GN

        self._gn = GN
        self.matcher = G.LLMatcher(tokenizer, grammar)
        if self.matcher.is_error():
            raise ValueError(self.matcher.get_error())
        self.n_vocab, self.n_prompt, self.consumed = n_vocab, n_prompt, 0
        self._mask = GN.allocate_token_bitmask(1, tokenizer.vocab_size)

    def allowed(self) -> np.ndarray:
        """The tokens that may come next, as a bool row of n_vocab."""
        self._gn.fill_next_token_bitmask(self.matcher, self._mask, 0)
        bits = np.unpackbits(self._mask[0].view(np.uint8), bitorder="little")
        return bits[:self.n_vocab].astype(bool)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """The logits with every token the constraint forbids at -inf."""
        return np.where(self.allowed(), logits, -np.inf).astype(logits.dtype, copy=False)

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise ValueError(f"constraint refused token {token}: {self.matcher.get_error()}")
        self.consumed += 1

    def replay(self, tokens) -> None:
        for t in tokens:
            self.consume(t)

    def masked(self, logits: np.ndarray, history) -> np.ndarray:
        """`logits` constrained for the token after `history` (the sequence's tokens so far): what was
        generated past the prompt and not fed yet is fed first. So one path serves a token sampled the
        tick before (a follow row), a session re-prefilled after a restart, and KV reused from the cache."""
        self.replay(history[self.n_prompt + self.consumed:])
        return self.apply(logits)

    @property
    def complete(self) -> bool:
        """Nothing but the end may follow: the output matches in full."""
        return self.matcher.is_stopped()
