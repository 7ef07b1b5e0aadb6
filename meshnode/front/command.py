"""`meshnode serve`: its flags, and settings in, an exit code out (2: a setting that cannot work, 1: a start
that failed). The CLI and the test entry (meshnode/dev/serve.py) both serve through here."""
from __future__ import annotations

import argparse
import logging
import os
import sys


def add_args(p: argparse.ArgumentParser) -> None:
    from meshnode.ops import flags

    p.add_argument("--config", help="TOML file with any serve setting; flags override it")
    flags.add_flags(p)  # every setting, from the one list of them


def serve_node(a, internal: dict | None = None) -> int:
    """`meshnode serve`; `internal` settings (an engine kind, faults) come only from meshnode/dev/serve.py."""
    from meshnode.front import signals

    signals.install()  # before the heavy imports below: a signal during start-up is a clean stop
    from meshnode.core.types import ConfigError
    from meshnode.front.node import serve
    from meshnode.ops import config

    keys = set(config.public_keys()) - {"model"}
    overrides = {k: getattr(a, k) for k in keys if hasattr(a, k)}
    overrides["model"] = a.model
    overrides.update(internal or {})
    try:
        cfg = config.load(a.config, overrides, os.environ)
    except ValueError as e:
        print(f"meshnode serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("meshnode.llama").setLevel(logging.WARNING)
    try:
        return serve(cfg)
    except ConfigError as e:  # a setting that turned out not to work once tried (a port in use)
        logging.getLogger("meshnode").error("cannot serve: %s", e)
        return 2
    except Exception as e:  # start-up failures: one clear line, not a traceback
        logging.getLogger("meshnode").error("cannot serve: %s", e)
        return 1
