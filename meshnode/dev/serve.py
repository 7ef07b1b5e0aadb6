"""`python -m meshnode.dev.serve SETTINGS_JSON [serve flags]`: a node with test and drill settings.

The production `meshnode serve` cannot choose a fake engine or inject faults;
tests and drills start their nodes through here (meshnode/dev/nodeproc.py),
with those settings as a JSON map of NodeConfig's internal keys.
"""
from __future__ import annotations

import json
import sys

from meshnode.cli import build_parser, serve_node


FAULTY = "meshnode.dev.faulty:Faulty"  # what injects `faults`: named here, so no production module imports it


def main(argv: list[str]) -> int:
    internal = json.loads(argv[0])
    if internal.get("faults"):
        internal.setdefault("engine_wrapper", FAULTY)
    return serve_node(build_parser().parse_args(["serve", *argv[1:]]), internal)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
