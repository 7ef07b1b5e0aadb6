"""llama.cpp's per-sequence state file (llama_state_seq_save_file), which a moving session's KV is, parsed whole.

A state file from a client, a hand-off peer or a persist folder is hostile until
proven otherwise: llama.cpp's own loader aborts the process on a file cut short
(GGML_ASSERT at EOF), and takes cells at any position it is given, which outlive
every later `seq_rm` (negative positions, 2^31-1) and steer other sessions'
attention. So the front parses every byte here, against the layout this node's
engine writes (`Layout`, learned from a file the engine wrote itself) and the
tokens the import names, and llama.cpp is handed only the file `canonical`
writes from the validated parts: one sequence, positions exactly 0..n-1, this
node's stream count, every value finite.

The format (llama-context.cpp state_seq_save_file, llama-kv-cache.cpp state_write):
  u32 magic, u32 version, u32 n_tokens, i32 tokens[n_tokens]
  u32 n_stream, then per stream: u32 cell_count, and where it is > 0:
    cell_count x (i32 pos, u32 n_seq_id, i32 seq_id[n_seq_id])
    u32 v_trans, u32 n_layer,
    per layer: i32 k_type, u64 k_row_bytes, k rows (cell_count x k_row_bytes)
    per layer, v not transposed: i32 v_type, u64 v_row_bytes, v rows
    per layer, v transposed:     i32 v_type, u32 v_elem_bytes, u32 n_embd_v, n_embd_v x cell_count elements
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = 0x67677371  # 'ggsq', LLAMA_STATE_SEQ_MAGIC
VERSION = 3  # LLAMA_STATE_SEQ_VERSION of the vendored llama.cpp
_HEAD = struct.Struct("<III")
_CELL = np.dtype([("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])
# ggml types a KV cache may hold: (block values, block bytes, byte offsets of the block's f16 scales)
_TYPES = {0: (1, 4, ()), 1: (1, 2, ()), 30: (1, 2, ()),  # f32, f16, bf16: every value checked itself
          2: (32, 18, (0,)), 3: (32, 20, (0, 2)), 6: (32, 22, (0,)), 7: (32, 24, (0, 2)),  # q4_0 q4_1 q5_0 q5_1
          8: (32, 34, (0,)), 20: (32, 18, (0,))}  # q8_0, iq4_nl
_NOT_FINITE = {0: ("<u4", 0x7F800000), 1: ("<u2", 0x7C00), 30: ("<u2", 0x7F80)}  # exponent all ones: inf, nan


@dataclass(frozen=True)
class Layout:
    """What a state file of this node's engine holds beside its cells: its stream count, whether V is
    transposed, and per layer the K type and row bytes and the V type and row bytes (transposed: element
    bytes and rows). Carried in EngineInfo.kv_state as the plain tuple `wire` gives."""

    n_stream: int
    v_trans: bool
    keys: tuple[tuple[int, int], ...]
    values: tuple[tuple[int, int, int], ...]  # (type, row bytes or element bytes, n_embd_v where transposed, else 0)

    def wire(self) -> tuple:
        return (self.n_stream, self.v_trans, self.keys, self.values)

    @classmethod
    def of(cls, wire) -> Layout | None:
        """The layout an EngineInfo carries; None where the engine described none (KV imports are refused)."""
        if not wire:
            return None
        n_stream, v_trans, keys, values = wire
        return cls(int(n_stream), bool(v_trans), tuple((int(t), int(r)) for t, r in keys),
                   tuple((int(t), int(r), int(e)) for t, r, e in values))

    def cell_bytes(self) -> int:
        """The bytes one cell takes in a file: its meta and its K and V."""
        v = sum(r * (e or 1) for _, r, e in self.values)
        return _CELL.itemsize + sum(r for _, r in self.keys) + v

    def size(self, n_tokens: int, cells: int) -> int:
        """The exact length of a file of `n_tokens` tokens and `cells` cells in one stream."""
        heads = 8 + 12 * (len(self.keys) + len(self.values))  # v_trans and n_layer; each layer's type and size
        return _HEAD.size + 4 * n_tokens + 4 + 4 * self.n_stream + (cells and heads + cells * self.cell_bytes())


class Reader:
    """Bounded reads over a file's bytes: a field past the end is a ValueError naming it, never a short read."""

    def __init__(self, buf):
        self.buf, self.at = buf, 0

    def take(self, n: int, what: str):
        if n < 0 or self.at + n > len(self.buf):
            raise ValueError(f"it ends inside its {what} (offset {self.at}, {n} bytes wanted, "
                             f"{len(self.buf)} in the file)")
        out = self.buf[self.at:self.at + n]
        self.at += n
        return out

    def u32(self, what: str) -> int:
        return int(np.frombuffer(self.take(4, what), "<u4")[0])

    def i32(self, what: str) -> int:
        return int(np.frombuffer(self.take(4, what), "<i4")[0])

    def u64(self, what: str) -> int:
        return int(np.frombuffer(self.take(8, what), "<u8")[0])


@dataclass
class Parsed:
    """A state file taken apart: its tokens and, per layer, the K and V bytes of its cells in position order."""

    tokens: list[int]
    keys: list
    values: list


def _head(r: Reader, what: str = "head") -> list[int]:
    magic, version, n = r.u32(what), r.u32(what), r.u32(what)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"it is not a llama.cpp sequence state of version {VERSION} (magic {magic:#x}, "
                         f"version {version})")
    return np.frombuffer(r.take(4 * n, "tokens"), "<i4").tolist()


def _finite(data, ggml_type: int, what: str) -> None:
    blck, size, scales = _TYPES[ggml_type]
    if len(data) % size:
        raise ValueError(f"its {what} is not whole {size}-byte blocks")
    raw = np.frombuffer(data, np.uint8)
    if ggml_type in _NOT_FINITE:
        dtype, mask = _NOT_FINITE[ggml_type]
        bad = (raw.view(dtype) & mask) == mask
    else:
        blocks = raw.reshape(-1, size)
        bad = np.zeros(len(blocks), bool)
        for off in scales:
            bad |= (blocks[:, off:off + 2].copy().view("<u2")[:, 0] & 0x7C00) == 0x7C00
    if bad.any():
        raise ValueError(f"its {what} holds {int(bad.sum())} values that are not finite")


def parse(buf, layout: Layout, tokens: list[int], n_seq_max: int) -> Parsed:
    """Every byte of a state file checked against this node's layout and the tokens its session names: the
    tokens exactly these, one stream of cells at positions exactly 0..n-1 of one sequence, each layer's
    types and row sizes this node's, every value finite, the file's length exact. ValueError names the
    first deviation."""
    r = Reader(memoryview(buf))
    got = _head(r)
    if got != list(tokens):
        raise ValueError(f"it was computed for other tokens than the {len(tokens)} its import names "
                         f"({len(got)} in the file)")
    _exact(len(buf), layout, len(tokens))
    n = len(tokens)
    n_stream = r.u32("stream count")
    if n_stream != layout.n_stream:
        raise ValueError(f"it has {n_stream} streams where this node has {layout.n_stream}")
    out = None
    for s in range(n_stream):
        count = r.u32("cell count")
        if count == 0:
            continue
        if out is not None:
            raise ValueError("it holds cells in more than one stream")
        if count != n:
            raise ValueError(f"it holds {count} cells for {n} tokens")
        out = _cells(r, layout, n, n_seq_max)
    if out is None and n:
        raise ValueError("it holds no cells")
    if r.at != len(buf):
        raise ValueError(f"it has {len(buf) - r.at} bytes after its cells")
    keys, values = out or ([], [])
    return Parsed(list(tokens), keys, values)


def _exact(size: int, layout: Layout, n: int) -> None:
    if size != layout.size(n, n):
        raise ValueError(f"it is {size} bytes where {n} positions take exactly {layout.size(n, n)} on this node")


def _cells(r: Reader, layout: Layout, n: int, n_seq_max: int) -> tuple[list, list]:
    cells = np.frombuffer(r.take(n * _CELL.itemsize, "cells"), _CELL)
    if (cells["n_seq"] != 1).any():
        raise ValueError("a cell belongs to other than one sequence")
    if (cells["pos"] != np.arange(n)).any():
        i = int(np.argmax(cells["pos"] != np.arange(n)))
        raise ValueError(f"cell {i} is at position {int(cells['pos'][i])}, not {i}: a sequence's cells are "
                         f"positions 0..{n - 1} in order")
    if (cells["seq"] < 0).any() or (cells["seq"] != cells["seq"][0]).any() or cells["seq"][0] >= max(n_seq_max, 1):
        raise ValueError("its cells are not of one sequence this node could hold")
    v_trans, n_layer = r.u32("V transposition"), r.u32("layer count")
    if v_trans != int(layout.v_trans) or n_layer != len(layout.keys):
        raise ValueError(f"it has {n_layer} layers, V transposed {bool(v_trans)}, where this node has "
                         f"{len(layout.keys)}, {layout.v_trans}")
    keys = []
    for il, (t, row) in enumerate(layout.keys):
        got = (r.i32("K type"), r.u64("K row size"))
        if got != (t, row):
            raise ValueError(f"layer {il}'s K is type {got[0]} of {got[1]} bytes a row, not {t} of {row}")
        keys.append(r.take(n * row, f"layer {il}'s K"))
        _finite(keys[-1], t, f"layer {il}'s K")
    values = []
    for il, (t, size, n_embd) in enumerate(layout.values):
        t_got = r.i32("V type")
        got = (t_got, r.u32("V element size"), r.u32("V width")) if layout.v_trans else (t_got, r.u64("V row size"))
        want = (t, size, n_embd) if layout.v_trans else (t, size)
        if got != want:
            raise ValueError(f"layer {il}'s V is {got}, not this node's {want}")
        values.append(r.take(n * size * (n_embd or 1), f"layer {il}'s V"))
        _finite(values[-1], t, f"layer {il}'s V")
    return keys, values


def write(path: str, layout: Layout, parsed: Parsed) -> int:
    """A state file of this node's layout from validated parts, created new (O_EXCL, never through a link):
    the only kind llama.cpp is given to load. Its bytes."""
    n = len(parsed.tokens)
    parts = [_HEAD.pack(MAGIC, VERSION, n), np.asarray(parsed.tokens, "<i4").tobytes(),
             struct.pack("<I", layout.n_stream)]
    for s in range(layout.n_stream):
        parts.append(struct.pack("<I", n if s == 0 else 0))
        if s or not n:
            continue
        cells = np.zeros(n, _CELL)
        cells["pos"], cells["n_seq"] = np.arange(n), 1
        parts += [cells.tobytes(), struct.pack("<II", int(layout.v_trans), len(layout.keys))]
        for (t, row), data in zip(layout.keys, parsed.keys):
            parts += [struct.pack("<iQ", t, row), data]
        for (t, size, n_embd), data in zip(layout.values, parsed.values):
            head = struct.pack("<iII", t, size, n_embd) if layout.v_trans else struct.pack("<iQ", t, size)
            parts += [head, data]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    with os.fdopen(fd, "wb") as f:
        for p in parts:
            f.write(p)
        return f.tell()


def canonical(src: str, dst: str, layout: Layout, tokens: list[int], n_seq_max: int) -> int:
    """`src` (anyone's) checked whole and written anew to `dst` (the node's): its bytes; ValueError why not."""
    with open(src, "rb", opener=_nofollow) as f:
        _exact(os.fstat(f.fileno()).st_size, layout, len(tokens))  # before a byte of it is read
        buf = f.read()
    return write(dst, layout, parse(buf, layout, tokens, n_seq_max))


def learn(path: str) -> Layout:
    """The layout of a state file this node's engine wrote itself (one sequence, at least one cell): how the
    engine describes its KV to the front. ValueError where it is not a layout this module can check (cells
    with extra fields, as M-RoPE models write, or a type it does not know): that engine's imports are refused."""
    with open(path, "rb") as f:
        r = Reader(memoryview(f.read()))
    n_tok = len(_head(r))
    n_stream = r.u32("stream count")
    for s in range(n_stream):
        count = r.u32("cell count")
        if count:
            break
    else:
        raise ValueError("it holds no cells")
    after = len(r.buf) - 4 * (n_stream - s - 1)  # the streams after this one: their (zero) cell counts
    r.take(count * _CELL.itemsize, "cells")
    v_trans, n_layer = r.u32("V transposition"), r.u32("layer count")
    if v_trans > 1 or not 0 < n_layer < 4096:
        raise ValueError("its cells are not the plain (position, sequence) kind")
    keys, values = [], []
    for _ in range(n_layer):
        t, row = r.i32("K type"), r.u64("K row size")
        if t not in _TYPES:
            raise ValueError(f"its K is of ggml type {t}, which this module does not check")
        keys.append((t, row))
        r.take(count * row, "K")
    while r.at < after and len(values) < n_layer:
        t = r.i32("V type")
        if t not in _TYPES:
            raise ValueError(f"its V is of ggml type {t}, which this module does not check")
        if v_trans:
            size, n_embd = r.u32("V element size"), r.u32("V width")
        else:
            size, n_embd = r.u64("V row size"), 0
        values.append((t, size, n_embd))
        r.take(count * size * (n_embd or 1), "V")
    layout = Layout(n_stream, bool(v_trans), tuple(keys), tuple(values))
    empty_after = r.at == after and not any(r.u32("cell count") for _ in range(n_stream - s - 1))
    if not empty_after or layout.size(n_tok, count) != len(r.buf):
        raise ValueError("its length is not the one its fields add up to")
    return layout


def tokens_of(buf) -> list[int]:
    """The tokens a state file's bytes hold the KV of (its head alone); ValueError when they are not such a file."""
    return _head(Reader(memoryview(buf)))


def _nofollow(path, flags):
    return os.open(path, flags | os.O_NOFOLLOW)
