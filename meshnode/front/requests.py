"""What each client request does: ping, status, cancel, submit (text tokenized off the loop).

Requests of one client are answered in order: while its text is being
tokenized on the worker thread (meshnode/text/jobs.py), the requests it sends
after it wait (a cancel must find the session it follows), at most MAX_HELD.
A text that cannot fit the context is refused before it is tokenized: the
lower bound on its token count costs nothing.
"""
from __future__ import annotations

from collections import deque

from ipc import protocol as P
from meshnode.core import reasons as R
from meshnode.core.scheduler import Scheduler
from meshnode.core.session import Ask, Session
from meshnode.core.telemetry import Telemetry
from meshnode.text.jobs import TextJob, TextJobs
from meshnode.text.tokenizer import Tokenizer

MAX_HELD = 256  # a client's requests waiting behind its text being tokenized


class Requests:
    def __init__(self, sched: Scheduler, tok: Tokenizer, texts: TextJobs, telemetry: Telemetry, *, reply,
                 send_events, status, opened, special_in_content: bool = False):
        """`reply(ident, frames)`, `send_events(events)`, `status(prompt_tokens) -> frames`, `opened(key)` (a session
        was admitted): the front's, so this class never touches a socket. `special_in_content`: chat content
        may spell special tokens (llama-server's behaviour; meshnode/text/chat.py)."""
        self.sched, self.tok, self.texts, self.telemetry = sched, tok, texts, telemetry
        self.reply, self.send_events, self.status, self.opened = reply, send_events, status, opened
        self.special_in_content = special_in_content
        self.held: dict[bytes, deque] = {}  # per client waiting behind its text: (frames, arrival)

    def on_frames(self, ident: bytes, frames: list[bytes]) -> None:
        arrived = self.sched.clock()  # a session's times count from here, tokenizer waits included
        held = self.held.get(ident)
        if held is None:
            self._handle(ident, frames, arrived)
        elif len(held) < MAX_HELD:
            held.append((frames, arrived))
        else:
            self.telemetry.count_bad_frame()
            self.reply(ident, P.error(R.TOO_LARGE, f"{MAX_HELD} requests already wait behind a text of this "
                                      "client that is being tokenized; read the answers before sending more",
                                      P.request_id(frames)))

    def _handle(self, ident: bytes, frames: list[bytes], arrived: float) -> None:
        try:
            req = P.decode_request(frames, self.tok.n_vocab)
        except P.ProtocolError as e:
            self.telemetry.count_bad_frame()
            self.reply(ident, P.error(e.code, e.detail, e.id))
            return
        if isinstance(req, P.Ping):
            self.reply(ident, P.pong())
        elif isinstance(req, P.Status):
            self.reply(ident, self.status(req.prompt_tokens))
        elif isinstance(req, P.Cancel):
            ev = self.sched.cancel((ident, req.id))
            if ev is None:
                self.reply(ident, P.error(R.UNKNOWN_SESSION, f"no live session {req.id!r}", req.id))
            else:
                self.send_events([ev])
        else:
            self._submit(ident, req, arrived)

    def _submit(self, ident: bytes, req: P.Submit, arrived: float) -> None:
        if req.tokens is not None:
            return self._admit(ident, req, req.tokens, arrived)
        prompt = req.text
        if req.messages is not None:
            try:
                prompt = self.tok.chat_prompt(req.messages, self.special_in_content)
            except ValueError as e:
                return self._refuse(ident, req.id, R.REJECTED_BAD_REQUEST, str(e))
        d = self.sched.precheck(Ask((ident, req.id), max(1, self.tok.min_tokens(prompt)), req.max_tokens, req.recipe))
        if not d.accepted:
            return self._refuse(ident, req.id, d.reason, d.detail)
        if not self.texts.submit((ident, req, arrived), prompt, owner=ident):
            return self._refuse(ident, req.id, R.REJECTED_QUEUE_FULL,
                                f"the tokenizer's backlog is full ({self.texts.max_backlog_chars} characters of "
                                "text wait); retry later or send tokens")
        self.held[ident] = deque()

    def on_text(self, job: TextJob) -> None:
        """A text is tokenized: admit it, then handle what its client sent behind it."""
        ident, req, arrived = job.key
        if job.error:
            self._refuse(ident, req.id, R.REJECTED_BAD_REQUEST, job.error)
        else:
            self._admit(ident, req, job.tokens, arrived)
        held = self.held.pop(ident, deque())
        while held:
            self._handle(ident, *held.popleft())
            if ident in self.held:  # waiting behind another text now
                self.held[ident].extend(held)
                return

    def _refuse(self, ident: bytes, id: str, reason: str, detail: str) -> None:
        self.telemetry.count_reject(reason)
        self.reply(ident, P.rejected(id, reason, detail))

    def _admit(self, ident: bytes, req: P.Submit, prompt: list[int], arrived: float) -> None:
        s = Session((ident, req.id), prompt, req.max_tokens, req.sampling, frozenset(req.stop_tokens),
                    req.ignore_eos, req.recipe, owner=ident, t_submit=arrived)
        d = self.sched.submit(s)
        if d.accepted:
            self.opened(s.key, req.stop)
            self.reply(ident, P.admitted(req.id, d.reason))
        else:
            self._refuse(ident, req.id, d.reason, d.detail)
