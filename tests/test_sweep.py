"""The concurrency sweep: schema on the real tiny model, corruption and saturation detection."""
import json

from meshnode.bench.sweep import find_mismatches, make_jobs, saturation, sweep

LEVEL_KEYS = {"concurrency", "ticks", "avg_batch_occupancy", "max_batch_occupancy", "tokens_per_tick",
              "gen_tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "peak_kv_bytes",
              "engine_peak_rss_bytes"}


def test_sweep_on_the_tiny_model_has_the_schema(tiny_model, tmp_path):
    res = sweep(tiny_model, [1, 2], make_jobs(4, [4, 16], 8))
    assert {"model", "recipe", "levels", "corruption_free", "mismatches", "saturation_concurrency",
            "machine"} <= set(res)
    assert [r["concurrency"] for r in res["levels"]] == [1, 2]
    for r in res["levels"]:
        assert LEVEL_KEYS <= set(r)
        assert r["peak_kv_bytes"] > 0 and r["engine_peak_rss_bytes"] > 0 and r["ticks"] > 0
    assert res["levels"][0]["max_batch_occupancy"] == 1 and res["levels"][1]["max_batch_occupancy"] == 2
    # identical tokens across levels is deterministic mode's promise; in the default mode a level may
    # part at a numerical tie, and the verdict must then say so (corruption is caught on the fake engine)
    assert res["corruption_free"] is (res["mismatches"] == [])
    assert json.loads(json.dumps(res)) == res


def test_sweep_reports_a_corrupted_session_at_one_level(tiny_model):
    fake = {"engine_kind": "fake"}
    corrupt = {"engine_kind": "fake", "fake": {"corrupt": [1]}}  # sequence slot 1 samples wrong tokens
    res = sweep(tiny_model, [1, 2], make_jobs(4, [3, 5], 6), internal_by_level={1: fake, 2: corrupt})
    assert res["corruption_free"] is False
    assert res["mismatches"] and all(m["concurrency"] == 2 for m in res["mismatches"])
    assert all(m["first_diff_pos"] == 0 for m in res["mismatches"])


def test_mismatch_reports_first_differing_position():
    ref = {"a": [1, 2, 3, 4], "b": [5, 6]}
    got = {"a": [1, 2, 9, 4], "b": [5, 6]}
    assert find_mismatches(ref, 4, got) == [{"concurrency": 4, "job": "a", "first_diff_pos": 2,
                                             "expected_len": 4, "got_len": 4}]
    assert find_mismatches(ref, 4, {"a": [1, 2], "b": [5, 6]})[0]["first_diff_pos"] == 2


def test_saturation_is_the_smallest_level_within_five_percent_of_the_best():
    rows = [{"concurrency": c, "gen_tokens_per_s": t} for c, t in [(1, 50), (2, 95), (4, 190), (8, 196)]]
    assert saturation(rows) == 4
    rows[2]["gen_tokens_per_s"] = 180  # 180 < 0.95 * 196
    assert saturation(rows) == 8
    assert saturation([]) is None
