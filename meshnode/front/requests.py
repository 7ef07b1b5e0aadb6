"""What each client request does: ping, status, cancel, submit (text tokenized, and chat rendered, off the loop).

Requests of one client are answered in order: while its text is being
tokenized on the worker thread (meshnode/text/jobs.py), the requests it sends
after it wait (a cancel must find the session it follows), at most MAX_HELD.
A text that cannot fit the context is refused before it is tokenized: the
lower bound on its token count costs nothing.

Handlers return what must happen (`Answer`s to clients, `Opened` sessions, the
scheduler's `Event`s) and the front's loop applies it: nothing here sends.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from ipc import link
from ipc import protocol as P
from ipc import events as E
from meshnode.core import reasons as R
from meshnode.core.admission import AdmissionDecision
from meshnode.core.scheduler import Event, Scheduler
from meshnode.core.session import Ask, Session
from meshnode.core.telemetry import Telemetry
from meshnode.core.types import Grammar
from meshnode.front.moves import Moves
from meshnode.text.chat import Chat
from meshnode.text.jobs import TextJob, TextJobs
from meshnode.text.tokenizer import Tokenizer

log = logging.getLogger("meshnode.front")

MAX_HELD = 256  # a client's requests waiting behind its text being tokenized


@dataclass(frozen=True)
class Answer:
    """Frames for one client."""

    ident: bytes
    frames: list[bytes]


@dataclass(frozen=True)
class Opened:
    """A session was admitted: its text stream (and stop strings) must exist before its first token."""

    session: Session
    stops: list[str]


Action = Answer | Opened | Event


class Requests:
    def __init__(self, sched: Scheduler, tok: Tokenizer, texts: TextJobs, telemetry: Telemetry, *, status,
                 moves: Moves, metrics=lambda: [], special_in_content: bool = False, pooling: str = "mean",
                 relayed=lambda key: False):
        """`status(prompt_tokens) -> frames`: the node's status answer (front/report.py); `metrics() -> frames`:
        its Prometheus text (front/prom.py).
        `moves`: the files of sessions moving between nodes (front/moves.py); `relayed(key)`: a cancel of a
        session a drain's handoff relays, passed on to the peer (front/handoff.py).
        `special_in_content`: chat content may spell special tokens (llama-server's behaviour;
        meshnode/text/chat.py)."""
        self.sched, self.tok, self.texts, self.telemetry = sched, tok, texts, telemetry
        self.status, self.metrics, self.pooling = status, metrics, pooling  # pooling: an `embed: true`'s
        self.moves, self.relayed = moves, relayed
        self.special_in_content = special_in_content
        self.held: dict[bytes, deque] = {}  # per client waiting behind its text: (frames, arrival)
        self._constraints = None  # llguidance over the served vocab, built for the first response_format

    def on_frames(self, ident: bytes, frames: list[bytes]) -> list[Action]:
        arrived = self.sched.clock()  # a session's times count from here, tokenizer waits included
        held = self.held.get(ident)
        if held is None:
            return self._handle(ident, frames, arrived)
        if len(held) < MAX_HELD:
            held.append((frames, arrived))
            return []
        self.telemetry.count_bad_frame()
        return [Answer(ident, E.error(R.TOO_LARGE, f"{MAX_HELD} requests already wait behind a text of this client "
                                      "that is being tokenized; read the answers before sending more",
                                      P.request_id(frames)))]

    def _handle(self, ident: bytes, frames: list[bytes], arrived: float) -> list[Action]:
        try:
            req = P.decode_request(frames, self.tok.n_vocab)
        except P.ProtocolError as e:
            self.telemetry.count_bad_frame()
            return [Answer(ident, E.error(e.code, e.detail, e.id))]
        except (TypeError, ValueError, KeyError, AttributeError, RecursionError, OverflowError) as e:
            # a shape the checks above the decoder missed: that request's BAD_REQUEST, never the node's end
            self.telemetry.count_bad_frame()
            log.warning("a request the protocol checks let through failed to decode: %r", e)
            return [Answer(ident, E.error(R.BAD_REQUEST, f"malformed request ({type(e).__name__})",
                                          P.request_id(frames)))]
        if isinstance(req, P.Ping):
            return [Answer(ident, E.pong())]
        if isinstance(req, P.Status):
            return [Answer(ident, self.status(req.prompt_tokens, ident))]
        if isinstance(req, P.Metrics):
            return [Answer(ident, self.metrics())]
        if isinstance(req, P.Export):
            return self._export(ident, req.id)
        if isinstance(req, P.KvChunk):
            return self._kv(ident, req, arrived)
        if isinstance(req, P.Cancel):
            ev = self.sched.cancel((ident, req.id))
            if ev is not None:
                return [ev]
            if self.relayed((ident, req.id)):
                return []
            self.telemetry.count_unknown_session()
            return [Answer(ident, E.error(R.UNKNOWN_SESSION, f"no live session {req.id!r}", req.id))]
        if isinstance(req, P.Count):
            return self._count(ident, req)
        return self._submit(ident, req, arrived)

    def _count(self, ident: bytes, c: P.Count) -> list[Action]:
        """A prompt's tokens, as a submit of it would have them, nothing admitted: ids at once, text and
        messages through the tokenizer's worker (its answer comes in on_text), behind the client's earlier ones."""
        req = c.submit
        if req.tokens is not None:
            return [Answer(ident, E.counted(req.id, len(req.tokens)))]
        return self._tokenize(ident, req.id, (ident, c, 0.0, None), self._prompt(req))

    def _tokenize(self, ident: bytes, id: str, key: tuple, prompt) -> list[Action]:
        """To the tokenizer's worker (on_text takes it back), the client's later requests held behind it."""
        if not self.texts.submit(key, prompt, owner=ident):
            return [self.refuse(ident, id, R.REJECTED_QUEUE_FULL,
                                f"the tokenizer's backlog is full ({self.texts.max_backlog_chars} characters of "
                                "text wait); retry later or send tokens")]
        self.held[ident] = deque()
        return []

    def _prompt(self, req: P.Submit):
        """A text or messages submit's prompt as the tokenizer's worker takes it: text (its special tokens parsed
        where asked), or the chat the template renders."""
        if req.messages is not None:  # the template runs on the tokenizer's worker, in its own process
            return Chat(req.messages, self.special_in_content, req.tools, req.add_generation_prompt,
                        req.continue_final_message)
        return self.tok.special_prompt(req.text) if req.special else req.text

    def _grammar(self, req: P.Submit) -> tuple[Grammar | None, str]:
        """The compiled response_format (None without one), or why it cannot be served."""
        if req.response_format is None:
            return None, ""
        if self._constraints is None:
            from meshnode.text.constraints import Constraints

            self._constraints = Constraints(self.tok.vocab, link.MAX_GRAMMAR_BYTES)
        return self._constraints.compile(req.response_format)

    def _submit(self, ident: bytes, req: P.Submit, arrived: float) -> list[Action]:
        if req.embed is True and self.pooling == "none":
            return [self.refuse(ident, req.id, R.REJECTED_BAD_REQUEST, "this node pools no embedding by default "
                                 "(pooling = none): name one (embed: mean, cls or last), or start it with another")]
        grammar, why = self._grammar(req)
        if why:  # before admission, with the library's own words
            self.telemetry.count_bad_frame()
            return [Answer(ident, E.error(R.BAD_REQUEST, why, req.id))]
        if req.kv is not None:
            return self._import(ident, req, arrived)
        if req.tokens is not None:
            return self._admit(ident, req, req.tokens, arrived, grammar)
        prompt = self._prompt(req)
        ask = Ask((ident, req.id), max(1, self.tok.min_tokens(prompt)), req.max_tokens or 1, req.recipe, req.priority)
        d = self.sched.precheck(ask)
        if not d.accepted:
            return [self.refuse(ident, req.id, d.reason, d.detail, d.facts)]
        return self._tokenize(ident, req.id, (ident, req, arrived, grammar), prompt)

    def on_text(self, job: TextJob) -> list[Action]:
        """A text is tokenized: admit it, then handle what its client sent behind it."""
        ident, req, arrived, grammar = job.key
        if isinstance(req, P.Count):
            out = [self.refuse(ident, req.submit.id, R.REJECTED_BAD_REQUEST, job.error) if job.error else
                   Answer(ident, E.counted(req.submit.id, len(job.tokens)))]
        elif job.error:
            out = [self.refuse(ident, req.id, R.REJECTED_BAD_REQUEST, job.error)]
        else:
            out = self._admit(ident, req, job.tokens, arrived, grammar)
        held = self.held.pop(ident, deque())
        while held:
            out += self._handle(ident, *held.popleft())
            if ident in self.held:  # waiting behind another text now
                self.held[ident].extend(held)
                break
        return out

    def _export(self, ident: bytes, id: str) -> list[Action]:
        """Take the session off this node (core/moves.py): its `exported` state and KV, then its `done`
        EXPORTED, come once the tick that saves it is answered (the output stage sends them)."""
        s = self.sched.live.get((ident, id))
        if s is None:
            self.telemetry.count_unknown_session()
            return [Answer(ident, E.error(R.UNKNOWN_SESSION, f"no live session {id!r}", id))]
        if s.grammar is not None or s.embed or s.export_to:
            self.telemetry.count_bad_frame()
            why = "it is being exported already" if s.export_to else \
                "a session with a response_format or an embedding does not move between nodes; cancel it and " \
                "submit it there"
            return [Answer(ident, E.error(R.BAD_REQUEST, why, id))]
        return self.sched.export(s.key, self.moves.path())

    def _import(self, ident: bytes, req: P.Submit, arrived: float) -> list[Action]:
        """An import with KV: refused now if it could not be admitted now, else its bytes are awaited."""
        key = (ident, req.id)
        d = self.sched.precheck(Ask(key, len(req.tokens), req.max_tokens, req.recipe, req.priority))
        if d.accepted and self.moves.receiving(key):
            d = AdmissionDecision(R.REJECTED_DUPLICATE, f"an import {req.id!r} of this client is receiving its KV")
        why = d.detail if not d.accepted else self.moves.begin(ident, req)
        if why:
            return [self.refuse(ident, req.id, d.reason if not d.accepted else R.REJECTED_BAD_REQUEST, why)]
        return []

    def _kv(self, ident: bytes, c: P.KvChunk, arrived: float) -> list[Action]:
        if not self.moves.receiving((ident, c.id)):
            self.telemetry.count_unknown_session()
            return [Answer(ident, E.error(R.UNKNOWN_SESSION, f"no import {c.id!r} is receiving its KV", c.id))]
        req, path, why = self.moves.chunk(ident, c)
        if why:
            return [self.refuse(ident, c.id, R.REJECTED_BAD_REQUEST, why)]
        if req is None:
            return []
        return self._admit(ident, req, req.tokens, arrived, kv_import=(path, req.kv.positions) if path else None)

    def checked(self, key: tuple, c) -> list[Action]:
        """An import's KV came whole and was checked off the loop (front/moves.py Checked): admit it, or say why
        not."""
        ident, id = key
        self.moves.checked_out(key)
        if c.why:
            return [self.refuse(ident, id, R.REJECTED_BAD_REQUEST, c.why)]
        return self._admit(ident, c.req, c.req.tokens, self.sched.clock(), kv_import=(c.path, c.req.kv.positions))

    def refuse(self, ident: bytes, id: str, reason: str, detail: str, facts: dict | None = None) -> Answer:
        self.telemetry.count_reject(reason)
        return Answer(ident, E.rejected(id, reason, detail, facts))

    def _admit(self, ident: bytes, req: P.Submit, prompt: list[int], arrived: float,
               grammar: Grammar | None = None, kv_import: tuple | None = None) -> list[Action]:
        # no max_tokens: what the session's context share leaves (llama-server's n_predict -1, vLLM's default)
        # an embedding asks one result (its vector) where a generation's token would come
        max_tokens = 1 if req.embed else req.max_tokens or max(1, self.sched.budget.n_ctx_seq - len(prompt))
        s = Session((ident, req.id), prompt, max_tokens, req.sampling, frozenset(req.stop_tokens),
                    req.ignore_eos, req.recipe, owner=ident, grammar=grammar, priority=req.priority, t_submit=arrived,
                    stop_text=bool(req.stop), embed=self.pooling if req.embed is True else req.embed or "",
                    tokens=prompt + req.generated if req.generated else [],  # an import goes on from there
                    kv_import=kv_import, progress=req.progress)
        d = self.sched.submit(s)
        if d.accepted:  # a queued session it displaced (priority policy) gets its `done` right after
            for _ in d.displaced:
                self.telemetry.count_reject(R.REJECTED_QUEUE_FULL)
            return [Opened(s, req.stop), Answer(ident, E.admitted(req.id, d.reason, prompt if req.echo else None)),
                    *d.displaced]
        return [self.refuse(ident, req.id, d.reason, d.detail, d.facts)]
