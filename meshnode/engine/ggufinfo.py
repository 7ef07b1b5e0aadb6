"""A GGUF file's tensor table, read without its metadata's values.

The gguf package's GGUFReader builds a Python object for every metadata value,
and a real model's vocabulary holds a hundred thousand strings (tokens and
merges): seconds per read, paid by every engine start and every check that
asks which formats a model's weights are in. Those checks need only the tensor
table, so this walks past the metadata (skipping each string by its length)
and reads the names, shapes and formats, in a fraction of that time.
"""
from __future__ import annotations

import mmap
import struct
from typing import NamedTuple

from gguf import GGMLQuantizationType

# the fixed size of each scalar metadata type, by its GGUF type number (8: string, 9: array are variable)
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # as GGUF stores it: the fastest-varying dimension first
    type_name: str  # GGMLQuantizationType's name: "F16", "Q8_0", ...


class GGUFError(ValueError):
    pass


def tensors(path: str) -> list[TensorInfo]:
    """The model's tensors, in file order; GGUFError when the file is not a GGUF this reads (v2 or v3,
    little-endian: what llama.cpp and the gguf package write)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return _Walk(m).tensors()


class _Walk:
    def __init__(self, buf):
        self.buf, self.at = buf, 0

    def _u(self, fmt: str) -> int:
        (v,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return v

    def _string(self) -> bytes:
        n = self._u("<Q")
        s = self.buf[self.at:self.at + n]
        self.at += n
        return s

    def _skip_value(self, vtype: int) -> None:
        if vtype in _SCALAR:
            self.at += _SCALAR[vtype]
        elif vtype == _STRING:
            self._string()
        elif vtype == _ARRAY:
            etype, count = self._u("<I"), self._u("<Q")
            if etype in _SCALAR:
                self.at += _SCALAR[etype] * count
            else:
                for _ in range(count):
                    self._skip_value(etype)
        else:
            raise GGUFError(f"unknown metadata type {vtype} at byte {self.at}")

    def tensors(self) -> list[TensorInfo]:
        if self.buf[:4] != b"GGUF":
            raise GGUFError("not a GGUF file (no GGUF magic)")
        self.at = 4
        version = self._u("<I")
        if version not in (2, 3):
            raise GGUFError(f"GGUF version {version} (big-endian, or not 2/3): not read here")
        n_tensors, n_kv = self._u("<Q"), self._u("<Q")
        for _ in range(n_kv):
            self._string()
            self._skip_value(self._u("<I"))
        out = []
        for _ in range(n_tensors):
            name = self._string().decode()
            n_dims = self._u("<I")
            shape = tuple(self._u("<Q") for _ in range(n_dims))
            ttype = self._u("<I")
            self.at += 8  # the data's offset
            out.append(TensorInfo(name, shape, GGMLQuantizationType(ttype).name))
        return out
