"""Hostile inputs shaped from honest ones, for tests and `python -m benchmarks hostile`: what an attacker who
holds a real export (and so computes its SHA-256 himself) can send instead of it.

`state_variants` takes an honest state file's bytes (one the node wrote: its layout is learned from it, as the
engine learns its own) and gives the named edits the findings of issue 66 made, each of which llama.cpp's own
loader took or died on; `random_edits` gives seeded byte edits in the file's head and cells, where a flip is a
structural change rather than a different (finite) value in the session's own KV.
"""
from __future__ import annotations

import hashlib
import os
import random
import struct
import tempfile

from ipc import moving as M
from ipc import seqstate

def _layout_of(data: bytes) -> seqstate.Layout:
    fd, path = tempfile.mkstemp(prefix="meshnode-hostile-")
    try:
        os.write(fd, data)
        return seqstate.learn(path)
    finally:
        os.close(fd)
        os.unlink(path)


def _offsets(data: bytes) -> dict:
    """Where the fields an attacker edits sit in an honest file: head, the cells' meta, the first K header."""
    n = struct.unpack_from("<I", data, 8)[0]
    at = 12 + 4 * n
    n_stream = struct.unpack_from("<I", data, at)[0]
    at += 4
    for s in range(n_stream):
        count = struct.unpack_from("<I", data, at)[0]
        at += 4
        if count:
            break
    cells = at
    kv = cells + 12 * count
    return {"n_tokens": 8, "n_stream": 12 + 4 * n, "count": cells - 4, "cells": cells, "n_cells": count,
            "v_trans": kv, "n_layer": kv + 4, "k_type": kv + 8, "k_row": kv + 12, "k_data": kv + 20}


def _put(data: bytes, at: int, fmt: str, value) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


def state_variants(data: bytes) -> dict[str, bytes]:
    """name -> a hostile edit of an honest state file."""
    o, layout = _offsets(data), _layout_of(data)
    cell = lambda i: o["cells"] + 12 * i  # noqa: E731
    last = o["n_cells"] - 1
    nan = b"\xff\xff\xff\x7f" if layout.keys[0][0] == 0 else b"\xff\x7f"
    k_first = o["k_data"]  # a float's bits, or a quantized block's f16 scale
    return {
        "one byte short": data[:-1],
        "one byte long": data + b"\0",
        "half": data[:len(data) // 2],
        "head only": data[:12],
        "last cell +100": _put(data, cell(last), "<i", last + 100),
        "a cell at 2^31-1": _put(data, cell(last), "<i", 2**31 - 1),
        "a cell at -5": _put(data, cell(0), "<i", -5),
        "two cells at one position": _put(data, cell(last), "<i", max(last - 1, 0)),
        "a cell in two sequences": _put(data, cell(0) + 4, "<I", 2),
        "a cell of sequence -1": _put(data, cell(0) + 8, "<i", -1),
        "a cell of sequence 9999": _put(data, cell(0) + 8, "<i", 9999),
        "more tokens than cells": _put(data, o["n_tokens"], "<I", struct.unpack_from("<I", data, 8)[0] + 1),
        "another stream count": _put(data, o["n_stream"], "<I", layout.n_stream + 1),
        "more cells than tokens": _put(data, o["count"], "<I", o["n_cells"] + 1),
        "V transposition flipped": _put(data, o["v_trans"], "<I", int(not layout.v_trans)),
        "a layer more": _put(data, o["n_layer"], "<I", len(layout.keys) + 1),
        "another K type": _put(data, o["k_type"], "<i", 8 if layout.keys[0][0] != 8 else 1),
        "another K row size": _put(data, o["k_row"], "<Q", layout.keys[0][1] * 2),
        "a NaN in the keys": data[:k_first] + nan + data[k_first + len(nan):],
        "another magic": _put(data, 0, "<I", 0x12345678),
    }


def random_edits(data: bytes, n: int, seed: int = 0) -> list[bytes]:
    """`n` seeded edits of the file's structure: 1-4 bytes set at random in its head, tokens and cells, or its
    length cut or grown."""
    rng = random.Random(seed)
    structure = _offsets(data)["k_data"]
    out = []
    for _ in range(n):
        b = bytearray(data)
        roll = rng.random()
        if roll < 0.15:
            out.append(bytes(b[:rng.randrange(len(b))]))
            continue
        if roll < 0.2:
            out.append(bytes(b) + bytes(rng.randrange(1, 64)))
            continue
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(structure)] = rng.randrange(256)
        out.append(bytes(b))
    return out


def mesh_key(folder: str) -> str:
    """A mesh key file as an operator makes one (32 random bytes, hex, mode 600), for nodes of one mesh in
    benchmarks and tests: they load each other's KV (front/moves.py: KV only from peers that prove who they are)."""
    path = os.path.join(folder, "mesh.key")
    with open(path, "wb") as f:
        f.write(os.urandom(32).hex().encode())
    os.chmod(path, 0o600)
    return path


def mac_of(key: bytes, state: dict) -> str:
    """The mesh key's signature of an exported `state`'s KV, for its recipe and tokens (ipc/moving.py, sign)."""
    kv = state["kv"]
    return M.sign(key, state["recipe"], M.KvHeader(kv["bytes"], kv["sha256"], kv["positions"]),
                  state["tokens"] + state["generated"]).mac


def send_state(c, id: str, state: dict, data: bytes, timeout_s: float | None = None, key: bytes | None = None) -> dict:
    """An import of `state` with `data` as its KV, the SHA-256 computed by its sender (and with the mesh `key`, its
    signature: a mesh member gone bad), from client `c`: the admission answer."""
    kv = {**state["kv"], "data": data, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if key is not None:
        kv["mac"] = mac_of(key, {**state, "kv": kv})
    c.open[id] = c.open.get(id, 0) + 1
    c.sock.send_multipart(M.import_request(id, {**state, "kv": kv}))
    for f in M.kv_requests(id, data):
        c.sock.send_multipart(f)
    return c.collect([id], timeout_s=timeout_s)[id].admission


# -- chat templates: the model file's code --------------------------------------------------------------------
TEMPLATES = {  # what a model file's template may do, each of which ended, froze or stalled the front once
    "zero division": "{{ 1 / 0 }}",
    "recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "overflow": "{{ 1e308 * 10 ** 5 }}{{ (2 ** 60) | float ** 40 }}",
    "a large power": "{{ 7 ** 12345678 }}",
    "a huge repetition": "{{ 'x' * 10 ** 9 }}",
    "a list repeated": "{% set l = [0] * 100000000 %}{{ l | length }}",
    "nested calls": "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}",
    "a bare loop": "{% set r = range(100000) | list %}{% for a in r %}{% for b in r %}{% endfor %}{% endfor %}",
    "a range past the sandbox": "{% for i in range(10 ** 10) %}{% endfor %}",
    "unsafe attributes": "{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}",
    "raise_exception": "{{ raise_exception('no') }}",
    "a filter that allocates": "{{ 'x' | center(2000000000) }}",
    "a string doubled": "{% set s = namespace(v='x') %}{% for i in range(40) %}{% set s.v = s.v ~ s.v %}{% endfor %}"
                        "{{ s.v | length }}",
}

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def branching_template() -> str:
    """One template that is ChatML for everyone but does TEMPLATES[name] where the first message's content is
    that name: a node serving it takes hostile renders beside honest chats."""
    arms = "".join(f"{{% elif messages[0].content == {name!r} %}}{body}" for name, body in TEMPLATES.items())
    return f"{{% if messages[0].content == '' %}}{arms}{{% else %}}{CHATML}{{% endif %}}"
