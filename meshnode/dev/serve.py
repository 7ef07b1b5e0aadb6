"""`python -m meshnode.dev.serve SETTINGS_JSON [serve flags]`: a node with test and drill settings.

The production `meshnode serve` cannot choose a fake engine or inject faults;
tests and drills start their nodes through here (meshnode/dev/nodeproc.py),
with those settings as a JSON map of NodeConfig's internal keys.
"""
from __future__ import annotations

import argparse
import json
import sys

from meshnode.front.command import add_args, serve_node


FAULTY = "meshnode.dev.faulty:Faulty"  # what injects `faults`: named here, so no production module imports it


def main(argv: list[str]) -> int:
    internal = json.loads(argv[0])
    if internal.get("faults"):
        internal.setdefault("engine_wrapper", FAULTY)
    parser = argparse.ArgumentParser(prog="python -m meshnode.dev.serve")
    add_args(parser)
    return serve_node(parser.parse_args(argv[1:]), internal)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
