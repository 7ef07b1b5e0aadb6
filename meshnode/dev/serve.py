"""`python -m meshnode.dev.serve SETTINGS_JSON [serve flags]`: a node with test and drill settings.

The production `meshnode serve` cannot choose a fake engine or inject faults;
tests and drills start their nodes through here (meshnode/dev/nodeproc.py),
with those settings as a JSON map of NodeConfig's internal keys.
"""
from __future__ import annotations

import argparse
import json
import sys

from meshnode.dev.engines import internal as node_settings
from meshnode.front.command import add_args, serve_node


def main(argv: list[str]) -> int:
    internal = node_settings(**json.loads(argv[0]))
    parser = argparse.ArgumentParser(prog="python -m meshnode.dev.serve")
    add_args(parser)
    return serve_node(parser.parse_args(argv[1:]), internal)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
