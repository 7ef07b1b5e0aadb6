"""Conversations across restarts (`kv_persist`): the prefix cache written at drain and read back at start, each
file checked before it may be loaded (front/persist.py)."""
import json
import os

from meshnode.dev.nodeproc import NodeProcess

ARGS = ("--deterministic", "--prefix-cache", "node", "--decode-steps-ms", "0", "--threads", "1")
TURN1 = [3 + (k * 31) % 500 for k in range(80)]
NEXT = [5 + (k * 17) % 400 for k in range(20)]


def _turn(c, sid: str, prompt: list[int]):
    return c.generate(sid, tokens=prompt, max_tokens=12, ignore_eos=True).done


def test_a_conversation_goes_on_after_a_restart_from_its_cached_kv_bitwise(tiny_model, tmp_path):
    folder = str(tmp_path / "kv")
    with NodeProcess(tiny_model, *ARGS, "--kv-persist", folder) as n, n.client() as c:
        first = _turn(c, "t1", TURN1)
        assert first["usage"]["cached_tokens"] == 0
    # the drain wrote the entry: a state file and its manifest
    assert sorted(os.path.splitext(f)[1] for f in os.listdir(folder)) == [".json", ".kv"]
    history = TURN1 + first["tokens"] + NEXT
    with NodeProcess(tiny_model, *ARGS) as other, other.client() as c:
        cold = _turn(c, "t2", history)  # the next turn on a node that never saw the first
        _turn(c, "t1", TURN1)
        warm = _turn(c, "t3", history)  # and on one that served the first and never stopped
    with NodeProcess(tiny_model, *ARGS, "--kv-persist", folder) as n, n.client() as c:
        got = _turn(c, "t2", history)
        assert "1 cached conversations read back" in n.log()
    # what the cache reuses is what a node that never stopped reuses (deterministic mode: a prompt's own
    # cells, docs/determinism.md), and the tokens are bitwise a cold node's
    assert got["usage"]["cached_tokens"] == warm["usage"]["cached_tokens"] > 0 and cold["usage"]["cached_tokens"] == 0
    assert got["tokens"] == cold["tokens"] == warm["tokens"]


def test_a_corrupt_or_foreign_file_is_skipped_with_one_line_and_never_loaded(tiny_model, tmp_path):
    folder = str(tmp_path / "kv")
    with NodeProcess(tiny_model, *ARGS, "--kv-persist", folder) as n, n.client() as c:
        _turn(c, "a", TURN1)
        _turn(c, "b", NEXT + TURN1)
    names = sorted(f for f in os.listdir(folder) if f.endswith(".kv"))
    assert len(names) == 2
    state = os.path.join(folder, names[0])
    data = bytearray(open(state, "rb").read())
    data[-5] ^= 0xFF  # a flipped bit in its KV
    open(state, "wb").write(bytes(data))
    manifest = os.path.join(folder, names[1].removesuffix(".kv") + ".json")
    m = json.load(open(manifest))
    json.dump({**m, "recipe": "mn1-0000000000000000"}, open(manifest, "w"))
    with NodeProcess(tiny_model, *ARGS, "--kv-persist", folder) as n, n.client() as c:
        log = n.log()
        assert log.count("skipped") == 2 and "SHA-256" in log and "another recipe" in log
        assert "0 cached conversations read back" in log
        assert _turn(c, "a2", TURN1 + NEXT)["usage"]["cached_tokens"] == 0
    assert not any(f.startswith("entry-") and f.endswith(".tmp") for f in os.listdir(folder))
