"""`python -m meshnode.dev.serve SETTINGS_JSON [serve flags]`: a node with test and drill settings.

The production `meshnode serve` cannot choose a fake engine or inject faults;
tests and drills start their nodes through here (meshnode/dev/nodeproc.py),
with those settings as a JSON map of NodeConfig's internal keys.
"""
from __future__ import annotations

import json
import sys

from meshnode.cli import build_parser, serve_node


def main(argv: list[str]) -> int:
    internal = json.loads(argv[0])
    return serve_node(build_parser().parse_args(["serve", *argv[1:]]), internal)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
