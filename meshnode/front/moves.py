"""The front's half of moving sessions: the KV files the engine saves and loads, and their bytes on the wire.

The engine writes a leaving session's KV to a file in this node's own folder
(core/moves.py says when); here it is read, hashed (SHA-256) and sent as the
`exported` event's `kv` and the `kv` events after it, then removed. An arriving
session's `kv` requests are written to a file as they come, in order, each
import bounded by what its positions can hold; when the last byte is in, the
checksum and the tokens in the file's head (ipc/seqstate.py) must be the ones
its state names, or it is refused before admission. The file then waits for the
tick that loads it and is removed once that tick is answered. An import whose
bytes stop coming for IMPORT_IDLE_S is refused and its file removed, so a client
that vanished half-way holds nothing.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
import queue
import shutil
import stat
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from ipc import protocol as P
from ipc import events as E
from ipc import moving as M
from ipc import seqstate
from meshnode.core import reasons as R
from meshnode.core.session import Event
from meshnode.core.types import Load

log = logging.getLogger("meshnode.front")
IMPORT_IDLE_S = 30.0  # an import whose next bytes take longer is refused
MAX_INCOMING = 64  # imports receiving their KV at once
MAX_INCOMING_PER_CLIENT = 4  # of them, one client's: one that holds its slots open starves nobody else


@dataclass(frozen=True)
class Checked:
    """An arrived KV's outcome: the node's own copy to load, or why it was refused."""

    req: P.Submit
    path: str
    why: str


@dataclass
class Incoming:
    req: P.Submit
    path: str
    file: object
    hasher: object = field(default_factory=hashlib.sha256)
    received: int = 0
    last: float = 0.0


class Moves:
    def __init__(self, layout: seqstate.Layout | None, n_seq_max: int, clock, max_bytes: int,
                 key: bytes | None = None, proven: bool = False):
        """`layout`: what this node's engine writes in a state file (None: it cannot say, and no KV is taken);
        `max_bytes`: what the imports receiving at once may hold on disk (the KV budget: they are headed there);
        `key`: the mesh key (mesh_key_file): exports are signed with it, and only signed KV is loaded;
        `proven`: every client proved who it is (CURVE keys with an allow list). KV is loaded only from peers that
        prove who they are, by the key or by CURVE: a parsed state file cannot show that its numbers are the
        model's, and a finished session's cells serve its client's later prompts (the prefix cache); from anyone
        else the import is prefilled from its tokens."""
        self.dir = tempfile.mkdtemp(prefix="meshnode-kv-")
        self.layout, self.n_seq_max, self.clock, self.max_bytes = layout, n_seq_max, clock, max_bytes
        self.key, self.proven = key, proven
        self.checking: set = set()  # imports whose whole KV is being parsed off the loop (ready() gives each)
        self.incoming: dict[tuple, Incoming] = {}
        self._names = itertools.count()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="meshnode-export")
        self._ready: queue.Queue = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)

    def path(self) -> str:
        """A new file in this node's folder, for a leaving session's KV."""
        return os.path.join(self.dir, f"{next(self._names)}.kv")

    # -- leaving ---------------------------------------------------------------------------------
    def exported(self, ev: Event, stops: list[str], recipe: str) -> list[list[bytes]] | None:
        """The frames that answer an export: its state and KV, or, for a session that ended first, why not;
        None where its KV is being read and hashed off the loop (a 176 MiB KV took the loop 0.2-0.4 s, every
        other session's stream waiting): `ready()` gives its frames then."""
        s = ev.session
        if ev.reason:
            remove(s.export_to)
            return [E.error(R.UNKNOWN_SESSION, f"session {s.key[1]!r} ended ({ev.reason}) before its export",
                            s.key[1])]
        state = self._state(ev, stops, recipe)
        if not ev.kv:
            remove(s.export_to)
            return [E.exported(s.key[1], state)]
        self._reader.submit(self._read, s.key, s.export_to, ev.kv[1], state)
        return None

    def state(self, ev: Event, stops: list[str], recipe: str) -> tuple[dict, bytes]:
        """A leaving session's state (its KV's description in it) and its KV's bytes, read now; the file goes."""
        state = self._state(ev, stops, recipe)
        data = self._with_kv(state, ev.session.export_to, ev.kv[1]) if ev.kv else b""
        remove(ev.session.export_to)
        return state, data

    @staticmethod
    def _state(ev: Event, stops: list[str], recipe: str) -> dict:
        s = ev.session
        return M.export_state(s.prompt, s.generated, s.max_tokens, s.sampling, sorted(s.stop_tokens), s.ignore_eos,
                              stops, s.priority, recipe)

    def _read(self, key: tuple, path: str, positions: int, state: dict) -> None:
        """The reader thread: the file's bytes and checksum into the state, its frames to the loop."""
        try:
            data = self._with_kv(state, path, positions)
        except Exception as e:  # noqa: BLE001 -- it leaves without its KV (prefilled where it goes), never unanswered
            log.warning("export of %s: its KV file could not be read (%r); it leaves without it", key[1], e)
            state.pop("kv", None)
            data = b""
        finally:
            remove(path)
        self._ready.put((key, [E.exported(key[1], state), *E.kv_parts(key[1], data)]))
        os.write(self._wake_w, b"x")

    def _check(self, key: tuple, req: P.Submit, src: str, tokens: list[int]) -> None:
        """The reader thread: an arrived KV parsed and written anew (`checked`), its outcome to the loop."""
        path, why = self.checked(src, tokens)
        self._ready.put((key, Checked(req, path, why)))
        os.write(self._wake_w, b"x")

    def _with_kv(self, state: dict, path: str, positions: int) -> bytes:
        """The KV file's bytes; its description (size, SHA-256, positions, and with a mesh key its signature)
        into `state`."""
        with open(path, "rb") as f:
            data = f.read()
        kv = P.KvHeader(len(data), hashlib.sha256(data).hexdigest(), positions)
        if self.key is not None:
            kv = M.sign(self.key, state["recipe"], kv, state["tokens"] + state["generated"])
        state["kv"] = {k: v for k, v in asdict(kv).items() if k != "mac" or v}  # unsigned: as before keys existed
        return data

    def fileno(self) -> int:
        """Readable when an export's frames are ready (the front's poller)."""
        return self._wake_r

    def ready(self) -> list[tuple[tuple, object]]:
        """(session key, frames) of the exports whose KV has been read, and (key, Checked) of the imports whose
        KV has been checked (the import may be admitted now)."""
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        out = []
        while True:
            try:
                out.append(self._ready.get_nowait())
            except queue.Empty:
                return out

    # -- arriving --------------------------------------------------------------------------------
    def begin(self, ident: bytes, req: P.Submit) -> str:
        """Wait for an import's KV bytes; why it cannot ("" when it can)."""
        kv = req.kv
        if self.layout is None:
            return "this node's engine cannot check KV state files; import without kv and it is prefilled"
        exact = self.layout.size(kv.positions, kv.positions)
        if kv.bytes != exact:
            return f"kv.bytes {kv.bytes} is not the {exact} that {kv.positions} positions take on this node"
        n = len(req.tokens or []) + len(req.generated or [])
        if kv.positions > n:
            return f"kv.positions {kv.positions} is more than the import's {n} tokens"
        if len(self.incoming) >= MAX_INCOMING:
            return f"{MAX_INCOMING} imports are receiving their KV already; retry later"
        if sum(1 for who, _ in self.incoming if who == ident) >= MAX_INCOMING_PER_CLIENT:
            return f"{MAX_INCOMING_PER_CLIENT} imports of this client are receiving their KV already; finish one first"
        held = sum(inc.req.kv.bytes for inc in self.incoming.values())
        if held + kv.bytes > self.max_bytes:
            return (f"the imports receiving now hold {held} of the {self.max_bytes} bytes of KV this node takes in "
                    f"at once; retry later")
        path = self.path()
        self.incoming[(ident, req.id)] = Incoming(req, path, open(path, "wb"), last=self.clock())
        return ""

    def receiving(self, key) -> bool:
        return key in self.incoming or key in self.checking

    def chunk(self, ident: bytes, c: P.KvChunk) -> tuple[P.Submit | None, str, str]:
        """One `kv` request of an import that is `receiving`: (None, "", why it failed: it is dropped then), or
        (the import, "", "") where it goes on prefilled (KV from a peer that proved nothing: `proven`), or nothing yet:
        a whole KV is parsed off the loop (a 176 MiB one took 0.2 s), its outcome comes from ready()."""
        inc = self.incoming[(ident, c.id)]
        kv = inc.req.kv
        if c.offset != inc.received or inc.received + len(c.data) > kv.bytes:
            self.drop((ident, c.id))
            return None, "", (f"kv at offset {c.offset} with {len(c.data)} bytes does not follow the "
                              f"{inc.received} received of {kv.bytes}; send the parts in order")
        inc.file.write(c.data)
        inc.hasher.update(c.data)
        inc.received += len(c.data)
        inc.last = self.clock()
        if inc.received < kv.bytes:
            return None, "", ""
        del self.incoming[(ident, c.id)]
        inc.file.close()
        if inc.hasher.hexdigest() != inc.req.kv.sha256:
            remove(inc.path)
            return None, "", "the KV's SHA-256 is not the one its import names: it was changed or cut on the way"
        tokens = inc.req.tokens + (inc.req.generated or [])
        untrusted = self._untrusted(inc.req, tokens)
        if untrusted:
            remove(inc.path)  # KV from outside the mesh: the session goes on, its KV computed here
            log.info("import %s: %s; it is prefilled", c.id, untrusted)
            return inc.req, "", ""
        self.checking.add((ident, c.id))
        self._reader.submit(self._check, (ident, c.id), inc.req, inc.path, tokens[:inc.req.kv.positions])
        return None, "", ""

    def _untrusted(self, req: P.Submit, tokens: list[int]) -> str:
        """Why an import's KV is not from a peer that proved who it is ("" when it is: `key`, `proven`)."""
        if self.key is not None:
            signed = M.signed(self.key, req.recipe or "", req.kv, tokens)
            return "" if signed else "its KV is not signed by this mesh's key"
        if self.proven:
            return ""
        return "this node takes KV only from peers with the mesh key or CURVE keys (mesh_key_file, curve_*)"

    def checked_out(self, key: tuple) -> None:
        """The loop took an import's Checked outcome."""
        self.checking.discard(key)

    def checked(self, src: str, tokens: list[int]) -> tuple[str, str]:
        """A state file from outside (an import's, a persist folder's) parsed whole against this node's layout
        and `tokens`, and written anew in this node's folder: (that file, "") or ("", why it was refused). Only
        such files are given to the engine (ipc/seqstate.py says why). `src` is removed when it is ours."""
        dst = self.path()
        try:
            if self.layout is None:
                raise ValueError("this node's engine cannot check KV state files")
            seqstate.canonical(src, dst, self.layout, tokens, self.n_seq_max)
            return dst, ""
        except (OSError, ValueError) as e:
            remove(dst)
            return "", f"the KV is not this node's to load: {e}"
        finally:
            if os.path.dirname(src) == self.dir:
                remove(src)

    def expired(self) -> list[tuple]:
        """Imports whose bytes stopped coming: dropped; their keys (each gets its refusal)."""
        now = self.clock()
        out = [key for key, inc in self.incoming.items() if now - inc.last > IMPORT_IDLE_S]
        for key in out:
            self.drop(key)
        return out

    def drop(self, key) -> None:
        inc = self.incoming.pop(key, None)
        if inc is not None:
            inc.file.close()
            remove(inc.path)

    def ran(self, plan) -> None:
        """A tick was answered or refused: the files it loaded (or would have) are no longer needed."""
        for op in plan.kv:
            if isinstance(op, Load) and os.path.dirname(op.path) == self.dir:  # every file a Load names (checked)
                remove(op.path)

    def close(self) -> None:
        for key in list(self.incoming):
            self.drop(key)
        self._reader.shutdown(wait=True)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        shutil.rmtree(self.dir, ignore_errors=True)




def remove(path: str) -> None:
    """Gone, whether it was there or not."""
    try:
        os.unlink(path)
    except (FileNotFoundError, TypeError):
        pass


def read_key(path: str) -> bytes:
    """A mesh key file, held to what ssh holds a private key to: a regular file of the node's user that no one
    else may read, of at least 32 bytes. ValueError, naming the fix, otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ValueError(f"mesh_key_file {path} must be a regular file of this user that no one else can read "
                             f"(mode {stat.S_IMODE(st.st_mode):04o}): chmod 600 {path}")
        key = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(key) < 32:
        raise ValueError(f"mesh_key_file {path} holds {len(key)} bytes; a mesh key is 32 or more "
                         "(e.g. head -c 32 /dev/urandom | base64 > FILE)")
    return key
