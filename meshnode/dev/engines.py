"""The engine factory tests and drills name (the node's internal `engine_factory` setting): the engine
process builds its engine here instead of llama.cpp's plain one, so no production module knows that
fakes or faults exist. `args` (the node's `engine_args`): `fake` (FakeEngine's keywords) for a fake in
place of llama.cpp, `faults` (one map per incarnation, the last for all after) for meshnode/dev/faulty.py
to inject."""
from __future__ import annotations

FACTORY = "meshnode.dev.engines:build"


def build(config, args: dict, generation: int):
    if args.get("fake") is not None:
        from meshnode.dev.fake import FakeEngine

        engine = FakeEngine(**args["fake"])
    else:
        from meshnode.engine.llama import LlamaEngine

        engine = LlamaEngine(config)
    faults = args.get("faults") or [None]
    mine = faults[min(generation, len(faults)) - 1]
    if mine:
        from meshnode.dev.faulty import Faulty

        engine = Faulty(engine, mine)
    return engine


def internal(engine_kind: str = "llama", fake: dict | None = None, faults: list | None = None, **rest) -> dict:
    """The internal settings a test names in its terms (engine_kind "fake" with `fake` keywords, `faults`)
    as the node's: engine_factory and engine_args."""
    if engine_kind == "fake" or faults:
        args = {"fake": dict(fake or {})} if engine_kind == "fake" else {}
        rest.update(engine_factory=FACTORY, engine_args={**args, **({"faults": faults} if faults else {})})
    return rest
