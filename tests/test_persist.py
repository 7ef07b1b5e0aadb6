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


# -- the folder as ssh treats its keys: pure, with the node's own check of a state file stood in for -------------
def _persist(folder, checked=lambda path, tokens: (path, "")):
    from meshnode.front.persist import KvPersist

    return KvPersist(str(folder), 1 << 30, "mn1-x", 64, checked)


def _entry(folder, i: int, data: bytes = b"kv", tokens=(5, 6, 7), **over) -> None:
    import hashlib

    m = {"recipe": "mn1-x", "tokens": list(tokens), "n_prompt": 2, "owner": None,
         "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), **over}
    (folder / f"entry-{i}.kv").write_bytes(data)
    (folder / f"entry-{i}.json").write_text(json.dumps(m))


def test_a_folder_others_can_write_or_not_the_nodes_is_refused_in_one_line(tmp_path):
    from meshnode.front.persist import folder_problem

    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    assert "writable by others" in folder_problem(str(open_to_all)) and "chmod go-w" in folder_problem(str(open_to_all))
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert "not a directory" in folder_problem(str(tmp_path / "link"))
    assert folder_problem(str(tmp_path / "new")) == "" and (tmp_path / "new").stat().st_mode & 0o077 == 0


def test_every_malformed_entry_is_skipped_with_one_line_and_the_good_one_kept(tmp_path, caplog):
    folder = tmp_path / "kv"
    folder.mkdir(mode=0o700)
    _entry(folder, 0)  # good
    (folder / "entry-1.json").write_bytes(b"[" * 200_000 + b"]" * 200_000)  # nested 200,000 deep
    (folder / "entry-1.kv").write_bytes(b"kv")
    (folder / "entry-2.kv").mkdir()  # a directory named like an entry
    _entry(folder, 3)
    (folder / "entry-3.kv").unlink()
    os.mkfifo(folder / "entry-3.kv")  # a FIFO: reading it would block the start for ever
    _entry(folder, 4, data=b"kv", bytes=2 << 30)  # a manifest naming 2 GiB
    _entry(folder, 5)
    (folder / "entry-5.kv").unlink()
    (folder / "entry-5.kv").symlink_to(folder / "entry-0.kv")  # a link to another entry
    _entry(folder, 6, tokens=[1, "x"])
    (folder / "entry-7.json").write_text(json.dumps({"recipe": "mn1-x"}))  # no fields
    _entry(folder, 8, n_prompt=99)
    with caplog.at_level("WARNING", "meshnode.front"):
        kept = _persist(folder).load(limit=64)
    assert [os.path.basename(k.path) for k in kept] == ["entry-0.kv"]
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 7, skipped  # 1, 3, 4, 5, 6, 7, 8; entry-2 has no manifest
    assert (folder / "entry-2.kv").is_dir()  # left, with its line, not fatal


def test_a_link_planted_at_a_temporary_name_redirects_nothing(tmp_path):
    folder = tmp_path / "kv"
    folder.mkdir(mode=0o700)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    (folder / "entry-0.kv.tmp").symlink_to(target)
    (folder / "entry-0.json.tmp").symlink_to(target)

    class Entry:
        used, tokens, seq_id, n_prompt, owner = 1.0, [5, 6], 0, 1, None

    p = _persist(folder)
    saving = p.to_save([Entry()])
    assert not os.path.lexists(saving[0][1])  # removed before the engine writes there
    open(saving[0][1], "wb").write(b"kv")  # what the engine writes
    assert p.commit(saving, {0: 2}) == 1
    assert target.read_bytes() == b"keep" and not (folder / "entry-0.json").is_symlink()
