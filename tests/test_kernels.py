"""Which kernels the node runs, said and accounted for: the build's patches (tools/install-llama records them),
the weights llama.cpp repacked (its load log), the recipe fingerprint, and where deterministic mode may use
repacked weights and turn flash attention's split-KV path off (docs/kernels.md, patches/README.md)."""
import pytest

from helpers import engine_config
from meshnode.engine import invariant, llamacpp
from meshnode.ops.models import make_model

LOAD = ["load_tensors:   CPU_Mapped model buffer size =   135.50 MiB",
        "load_tensors:   CPU_REPACK model buffer size =   136.27 MiB",
        "llama_kv_cache:        CPU KV buffer size =    90.00 MiB"]
PATCHED = [llamacpp.Q8_0_REPACK_PATCH, "0002-tests-repack-mul-mat.patch", llamacpp.FA_SPLIT_PATCH]


def test_the_kernels_phrase_names_the_build_and_the_repacked_weights(monkeypatch):
    monkeypatch.setattr(llamacpp, "patches", lambda: PATCHED)
    assert llamacpp.kernels(LOAD) == ("patched (0001-ggml-cpu-x86-q8_0-repack, 0002-tests-repack-mul-mat, "
                                      "0003-ggml-cpu-flash-attn-split-kv-switch), 136.3 MiB of weights repacked")
    monkeypatch.setattr(llamacpp, "patches", lambda: [])
    assert llamacpp.kernels(LOAD[:1]) == "stock, no weights repacked"


def test_the_installed_build_says_its_patches(tmp_path):
    """What tools/install-llama wrote beside the installed llama_cpp package, read back (none: a stock build)."""
    import os

    import llama_cpp

    listed = os.path.join(os.path.dirname(llama_cpp.__file__), "meshnode-patches.txt")
    want = [ln.strip() for ln in open(listed) if ln.strip()] if os.path.exists(listed) else []
    assert list(llamacpp.patches()) == want
    assert all(p.endswith(".patch") and os.path.exists(os.path.join("patches", p)) for p in want)


def test_the_recipe_changes_with_the_builds_patches(tmp_path, monkeypatch):
    """Other kernels give other bits: a router must not mix a patched node's sessions with a stock one's."""
    model = str(make_model(tmp_path / "m.gguf", "tiny", 0))
    monkeypatch.setattr(llamacpp, "patches", lambda: [])
    stock = engine_config(model).recipe()
    monkeypatch.setattr(llamacpp, "patches", lambda: PATCHED)
    assert engine_config(model).recipe() != stock


@pytest.mark.parametrize("patched", [False, True])
def test_deterministic_mode_takes_repacked_weights_only_where_they_keep_a_rows_bits(tmp_path, monkeypatch, patched):
    """q8_0 repacked by the patched x86 kernels sums a row alike in any batch; other repacked formats, and q8_0
    on a stock build, run one kernel for one row and another for several, so deterministic mode keeps them in
    the plain buffer (outside it they are repacked wherever the CPU has a layout)."""
    monkeypatch.setattr(llamacpp, "amx_crashes", lambda: False)
    monkeypatch.setattr(llamacpp, "patches", lambda: PATCHED if patched else [])
    q8 = str(make_model(tmp_path / "q8.gguf", "tiny-f16", 0, "q8_0"))
    f16 = str(make_model(tmp_path / "f16.gguf", "tiny-f16", 0))
    for path, repacks in ((q8, patched), (f16, False)):
        assert engine_config(path, kv_layout="streams", deterministic=True).extra_buffers is repacks
        assert engine_config(path, kv_layout="streams", deterministic=False).extra_buffers is True


def test_only_q8_0_beside_formats_x86_leaves_unrepacked_counts_as_invariant_when_repacked(monkeypatch):
    """A Q4_1 file's q8_0 output repacks while its Q4_1 layers stay (no x86 layout): still one kernel a row; a Q4_0
    or q4_K beside it would repack into upstream's kernels, whose gemv and gemm differ."""
    monkeypatch.setattr(llamacpp, "patches", lambda: PATCHED)
    assert llamacpp.invariant_repack({"Q8_0"}) and llamacpp.invariant_repack({"Q8_0", "Q4_1"})
    assert not llamacpp.invariant_repack({"Q4_1"}) and not llamacpp.invariant_repack({"Q8_0", "Q4_0"})
    assert not llamacpp.invariant_repack({"Q8_0", "Q4_K", "Q6_K"})
    monkeypatch.setattr(llamacpp, "patches", lambda: [])
    assert not llamacpp.invariant_repack({"Q8_0"})


def test_with_the_split_switch_a_lone_row_deep_in_its_stream_needs_no_padding_row():
    """An f16 K and V cache on 2 threads: the split-KV path makes a lone row past 256 cells differ; a build with
    patches/0003 turns the path off in deterministic mode, so no row pays (the start-up check confirms it)."""
    assert invariant.expected_pads({"Q8_0"}, "f16", "f16", False, 2) == invariant.LonePads(False, True)
    assert invariant.expected_pads({"Q8_0"}, "f16", "f16", False, 2, split_off=True) == invariant.LonePads(False, False)
    assert invariant.lone_cost({"Q8_0"}, "f16", "f16", False, 2, split_off=True) == ""
    assert "split-KV" in invariant.lone_cost({"Q8_0"}, "f16", "f16", False, 2)
