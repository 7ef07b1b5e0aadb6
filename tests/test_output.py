"""The output stage (front/output.py), pure: every session gets exactly one `done`, with the reason of whoever
ended it first, and what the output stage ends is handed to the scheduler once."""
from ipc import events as E
from meshnode.core import reasons as R
from meshnode.core.scheduler import Event
from meshnode.core.session import DONE, RUNNING, Session
from meshnode.front.outbox import SENT, STALLED
from meshnode.front.output import Finish, Output


class Tok:  # token t spells chr(t): enough for text streams and stop strings
    def piece(self, t):
        return chr(t).encode()

    def decode(self, tokens):
        return "".join(map(chr, tokens))


class Telemetry:
    client_faults_total = 0


class Wire:
    """The clients' side: what each one received, and which identities stop reading at their next send."""

    def __init__(self):
        self.got, self.stall = [], set()

    def send(self, ident, frames, final):
        self.got.append((ident, E.decode_event(frames)))
        if ident in self.stall:
            self.stall.discard(ident)
            return STALLED
        return SENT

    def events(self, ident, kind):
        return [ev for i, ev in self.got if i == ident and ev["event"] == kind]


def running(key, prompt=(ord("p"),)):
    s = Session(key, list(prompt), 10)
    s.state = RUNNING
    return s


def test_a_stop_string_ends_the_session_here_once_and_the_schedulers_own_done_is_not_sent_again():
    wire = Wire()
    out = Output(Tok(), wire.send, Telemetry())
    s = running((b"c", "a"))
    out.opened(s, ["XY"])
    finishes = []
    for ch in "abX":
        s.tokens.append(ord(ch))
        finishes += out.process([Event("tokens", s, [ord(ch)])])
    assert finishes == []
    s.tokens.append(ord("Y"))
    s.state = DONE  # the same token was its last (LENGTH): the scheduler's done comes in the same batch
    finishes = out.process([Event("tokens", s, [ord("Y")]), Event("done", s, s.generated, R.LENGTH)])
    assert finishes == [Finish((b"c", "a"), R.STOP)]
    [done] = wire.events(b"c", "done")
    assert done["reason"] == R.STOP and done["text"] == "ab"  # cut before the match, no second done
    assert "".join(ev["text"] for ev in wire.events(b"c", "tokens")) == "ab"


def test_a_stalled_client_loses_its_live_sessions_each_with_its_done_and_nobody_else_does():
    wire, tele = Wire(), Telemetry()
    out = Output(Tok(), wire.send, tele)
    a, b, ended, other = running((b"c", "a")), running((b"c", "b")), running((b"c", "e")), running((b"o", "x"))
    for s in (a, b, ended, other):
        out.opened(s)
    ended.state = DONE  # the scheduler ended it (EOS) in this batch: its done is further down the events
    wire.stall.add(b"c")
    a.tokens.append(ord("z"))
    events = [Event("tokens", a, [ord("z")]), Event("done", ended, [], R.EOS), Event("tokens", other, [ord("q")])]
    finishes = out.process(events)
    assert sorted(finishes, key=lambda f: f.key) == [Finish((b"c", k), R.CANCELLED) for k in ("a", "b")]
    dones = {ev["id"]: ev for ev in wire.events(b"c", "done")}
    assert {k: ev["reason"] for k, ev in dones.items()} == {"a": R.CANCELLED, "b": R.CANCELLED, "e": R.EOS}
    assert "stopped reading" in dones["a"]["detail"] and tele.client_faults_total == 1
    assert wire.events(b"o", "tokens") and not wire.events(b"o", "done")  # the other client goes on
    assert set(out.streams) == {(b"o", "x")}
