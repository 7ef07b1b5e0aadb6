"""JSON values from outside, bounded before anything walks them recursively.

A value nested ~1,000 deep is fine for msgpack and for `json.loads` just under
Python's recursion limit, and then ends whatever walks it next (`json.dumps`, a
template's `tojson`, a schema compiler) with a RecursionError far from the edge
it came in on; a msgpack bin value or bin map key is no JSON at all and raised
TypeError from `json.dumps` inside the front's loop. So every JSON value a
client sends is checked here, at the edge, iteratively: JSON types only, string
keys, finite numbers, at most MAX_DEPTH deep. ValueError names what is wrong.
"""
from __future__ import annotations

import json
import math
import re

import numpy as np

MAX_DEPTH = 64  # JSON schemas, tool arguments and manifests nest far less; json.dumps recurses once a level
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')


def check(v, what: str, max_depth: int = MAX_DEPTH) -> None:
    """`v` is a JSON value (None, bool, int, finite float, str, list, str-keyed dict) at most `max_depth` deep."""
    todo = [(v, 1)]
    while todo:
        x, depth = todo.pop()
        if isinstance(x, (dict, list)):
            if depth > max_depth:
                raise ValueError(f"{what} nests deeper than {max_depth}")
            if isinstance(x, dict):
                if not all(isinstance(k, str) for k in x):
                    raise ValueError(f"{what} has a key that is not a string")
                todo += [(y, depth + 1) for y in x.values()]
            else:
                todo += [(y, depth + 1) for y in x]
        elif isinstance(x, float):
            if not math.isfinite(x):
                raise ValueError(f"{what} holds a number that is not finite")
        elif not (x is None or isinstance(x, (bool, int, str))):
            raise ValueError(f"{what} holds a {type(x).__name__} value, which is not JSON")


def depth(raw: bytes) -> int:
    """How deep a JSON text's brackets nest (strings skipped), counted without recursing."""
    bare = np.frombuffer(_STRINGS.sub(b"", raw), np.uint8)
    steps = np.isin(bare, (0x5B, 0x7B)).astype(np.int64) - np.isin(bare, (0x5D, 0x7D))
    return int(np.cumsum(steps).max(initial=0))


def loads(text: str | bytes, what: str, max_depth: int = MAX_DEPTH):
    """JSON text parsed, its depth bounded before the parser recurses; ValueError where it is not such text."""
    raw = text.encode() if isinstance(text, str) else text
    if depth(raw) > max_depth:
        raise ValueError(f"{what} nests deeper than {max_depth}")
    try:
        v = json.loads(raw)
    except (TypeError, ValueError, RecursionError):
        raise ValueError(f"{what} is not JSON text") from None
    check(v, what, max_depth)
    return v
