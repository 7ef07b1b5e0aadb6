"""One session's output constraint in the engine process, where its tokens are sampled.

An llguidance matcher (grammar compiled by the front, meshnode/text/constraints.py) says which tokens may
come next; the disallowed ones' logits become -inf before sampling, so greedy and seeded draws alike pick
an allowed token, and logprobs describe the constrained distribution. Each sampled token advances the
matcher; a restarted engine rebuilds it by replaying the tokens generated so far.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from meshnode.core.types import Constrained, ConstraintFailed

KEEP = 64  # parsed grammars kept: a new session on a known grammar copies its matcher instead of parsing


class Matchers:
    """The engine's matchers over its model's own vocabulary (llguidance's tokenizer, built once)."""

    def __init__(self, tokenizer, n_vocab: int):
        import llguidance
        import llguidance.numpy

        self._g, self._gn = llguidance, llguidance.numpy
        self.tokenizer, self.n_vocab = tokenizer, n_vocab
        self._parsed: OrderedDict[str, object] = OrderedDict()  # grammar key -> a matcher that never consumes

    def start(self, c: Constrained) -> Constraint:
        template = self._parsed.pop(c.grammar.key, None)
        if template is None:
            template = self._g.LLMatcher(self.tokenizer, c.grammar.text)
            if template.is_error():
                raise ConstraintFailed(template.get_error())
        self._parsed[c.grammar.key] = template
        if len(self._parsed) > KEEP:
            self._parsed.popitem(last=False)
        return Constraint(template.deep_copy(), self._gn.allocate_token_bitmask(1, self.tokenizer.vocab_size),
                          self._gn, self.n_vocab, c.n_prompt)


class Constraint:
    def __init__(self, matcher, mask: np.ndarray, gn, n_vocab: int, n_prompt: int):
        self.matcher, self._mask, self._gn = matcher, mask, gn
        self.n_vocab, self.n_prompt, self.consumed = n_vocab, n_prompt, 0

    def allowed(self) -> np.ndarray:
        """The tokens that may come next, as a bool row of n_vocab; ConstraintFailed where the matcher
        stopped on an error (a limit of the library) or allows nothing (the output can never match)."""
        self._gn.fill_next_token_bitmask(self.matcher, self._mask, 0)
        if self.matcher.is_error():
            raise ConstraintFailed(self.matcher.get_error())
        bits = np.unpackbits(self._mask[0].view(np.uint8), bitorder="little")[:self.n_vocab].astype(bool)
        if not bits.any():
            raise ConstraintFailed("no token can continue the output: the constraint can never be satisfied")
        return bits

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """The logits with every token the constraint forbids at -inf."""
        return np.where(self.allowed(), logits, -np.inf).astype(logits.dtype, copy=False)

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise ConstraintFailed(f"constraint refused token {token}: {self.matcher.get_error()}")
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
