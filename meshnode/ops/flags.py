"""The settings as people write them: `meshnode serve` flags and tools/meshnode.toml.example, both made
from NodeConfig's one list (meshnode/ops/config.py), so neither can name a setting that does not exist."""
from __future__ import annotations

import argparse

from meshnode.ops.config import _public, _type_of


def _toml(v) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else f'"{v}"' if isinstance(v, str) else repr(v)


EXAMPLE_HEADER = """# /etc/meshnode/node.toml: every `meshnode serve` setting (flags override the file). Values shown are
# the defaults, except where a key is commented out (then the default is derived as described).
# Written by `meshnode config-example` from meshnode/ops/config.py, the one list of settings.
"""


def _help(f) -> str:
    """The setting's line, its choices added unless it names them all."""
    m = f.metadata
    if "choices" not in m or all(c in m["help"] for c in m["choices"]):
        return m["help"]
    return f"{m['help']}: {', '.join(m['choices'])}"


def example_file() -> str:
    """tools/meshnode.toml.example, from the settings themselves: every key, its default, its line."""
    lines = [EXAMPLE_HEADER]
    for f in _public():
        m = f.metadata
        line = f"{f.name} = {_toml(f.default)}" if f.default is not None else f"# {f.name} = {_toml(m['example'])}"
        lines.append(f"{line:<49} # {_help(f)}")
    return "\n".join(lines) + "\n"


def add_flags(parser) -> None:
    """A `--flag` for every setting, with its type, choices and one line of help; unset flags stay None,
    so the config file's value (or the default) holds."""
    for f in _public():
        m, flag = f.metadata, f"--{f.name.replace('_', '-')}"
        want = _type_of(f)
        if want is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=m["help"])
            continue
        rng = f" [{m['range'][0]:g}, {m['range'][1]:g}]" if "range" in m else ""
        # choices are checked with the file's values (one line naming the key, case-insensitive log level)
        parser.add_argument(flag, *m["aliases"], dest=f.name, type=want, metavar=f.name.upper(), help=_help(f) + rng)
