"""Everything the node needs to know about llama.cpp itself, in one public place.

Log routing (into Python logging, keeping the last errors so a refusal can be
reported in llama.cpp's own words), ggml's abort hook (a GGML_ASSERT becomes
one line for the front instead of a gdb backtrace on stderr), the KV type and
flash-attention tables, KV row sizes, the model file digest and the recipe
fingerprint, and the build's system info. Importing this module does not load
llama.cpp; the functions that need it import it.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
from collections import deque

from meshnode.core.types import FatalEngineError

log = logging.getLogger("meshnode.llama")

KV_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2}  # name -> ggml type
QUANTIZED_KV = {"q8_0", "q4_0"}  # llama.cpp refuses these for V without flash attention
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
KV_LAYOUTS = ("streams", "unified")  # n_ctx / n_seq_max cells per sequence, or one pool for all
MAX_SEQ = 256  # LLAMA_MAX_SEQ: llama.cpp refuses a context with more sequences
_TYPE_SIZE = {0: (1, 4), 1: (1, 2), 30: (1, 2), 8: (32, 34), 2: (32, 18)}  # ggml type -> block, bytes
# ggml_log_level -> ours: llama.cpp's INFO is its loader's chatter (~70 lines a load), DEBUG here; the node's own
# ready lines say what matters of it
_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
_LOG_CB = None  # ctypes keeps only a weak pointer: a collected callback crashes the process
_ABORT_CB = None
_ERRORS: deque[str] = deque(maxlen=8)  # llama.cpp's last error lines
# where llama.cpp put the model: "layer N assigned to device X" (debug) and the model / KV buffer sizes
_PLACEMENT_MARKS = ("assigned to device", "model buffer size", "KV buffer size")
_PLACEMENT: list[str] = []
# what llama.cpp says of a llama_decode its abort callback stopped (GGML_STATUS_ABORTED = 1, rc 2): only a hurried
# tick sets the callback (engine/llama.py), so these are the node's own doing
_STOPPED_MARKS = ("compute status: 1", "failed with error 1", "failed to decode, ret = 2", "removing memory module")


def install_log() -> None:
    """Route llama.cpp's log into Python logging, once per process."""
    global _LOG_CB
    if _LOG_CB is not None:
        return
    import llama_cpp

    def forward(level, text, _user):
        msg = text.decode("utf-8", "replace").rstrip("\n") if text else ""
        if msg:
            lvl = _LEVELS.get(level, logging.DEBUG)
            if any(m in msg for m in _STOPPED_MARKS):  # a call the node stopped itself (a hurry), not an error
                lvl = logging.DEBUG
            elif lvl >= logging.ERROR:
                _ERRORS.append(msg.strip())
            if any(m in msg for m in _PLACEMENT_MARKS):
                _PLACEMENT.append(msg.strip())
            log.log(lvl, "%s", msg)

    _LOG_CB = llama_cpp.llama_log_callback(forward)
    llama_cpp.llama_log_set(_LOG_CB, ctypes.c_void_p())
    llama_cpp.llama_backend_init()


def supports_rpc() -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_supports_rpc())


def placement_lines() -> list[str]:
    """llama.cpp's lines about where the last model load put layers and buffers (taken, not copied)."""
    lines = _PLACEMENT[:]
    _PLACEMENT.clear()
    return lines


# patches/ whose kernels keep a row's bits whatever else is in its call (tools/install-llama records the ones applied)
Q8_0_REPACK_PATCH = "0001-ggml-cpu-x86-q8_0-repack.patch"  # repacked q8_0 matmuls on x86 (AVX2, AVX-512 VNNI)
FA_SPLIT_PATCH = "0003-ggml-cpu-flash-attn-split-kv-switch.patch"  # GGML_CPU_FA_SPLIT_KV=0 turns the split off


# formats ggml leaves in the plain buffer on x86 even with its extra buffer types on (no repacked layout there)
NOT_REPACKED_X86 = frozenset({"Q4_1"})


def invariant_repack(weight_types: set[str]) -> bool:
    """Whether these weights, with llama.cpp's extra buffer types on, keep a row's bits in any batch: q8_0 repacked
    by the patched x86 kernels (docs/kernels.md), beside formats that stay where they are (a Q4_1 file's q8_0
    output). Other repacked formats run one kernel for a single row and another for several."""
    return ("Q8_0" in weight_types and weight_types <= {"Q8_0"} | NOT_REPACKED_X86
            and Q8_0_REPACK_PATCH in patches() and "AVX2 = 1" in system_info())


@functools.cache
def patches() -> tuple[str, ...]:
    """The patches (patches/) the installed llama-cpp-python's llama.cpp was built with, as tools/install-llama
    recorded them; () for a stock build (or one installed another way). Read once: the build a process loaded does
    not change under it."""
    import llama_cpp

    try:
        with open(os.path.join(os.path.dirname(llama_cpp.__file__), "meshnode-patches.txt")) as f:
            return tuple(line.strip() for line in f if line.strip())
    except OSError:
        return ()


def split_kv_switch() -> bool:
    """Whether this build can turn flash attention's split-KV path off (patches/0003, invariant.SPLIT_OFF_ENV)."""
    return FA_SPLIT_PATCH in patches()


def kernels(placement: list[str]) -> str:
    """Which CPU kernels the loaded model runs, in one phrase: the build (stock or its patches) and how much of the
    weights ggml repacked into its interleaved layouts (a "CPU_REPACK model buffer" in the load log `placement`),
    the ones whose matmuls read each block once for all the rows of a call."""
    repacked = sum(float(m.group(1)) for line in placement
                   for m in [re.search(r"CPU_REPACK model buffer size\s*=\s*([0-9.]+) MiB", line)] if m)
    applied = patches()
    build = f"patched ({', '.join(p.removesuffix('.patch') for p in applied)})" if applied else "stock"
    return f"{build}, {repacked:.1f} MiB of weights repacked" if repacked else f"{build}, no weights repacked"


def last_errors() -> str:
    """llama.cpp's recent error lines, joined: what it said when it refused something."""
    return "; ".join(_ERRORS)


def ggml_library(stem: str) -> ctypes.CDLL:
    """The copy of ggml library `stem` ("libggml-base", "libggml") that llama.cpp itself loaded. The wheel
    ships each library under three names as separate files (no symlinks), so opening another name maps a
    second copy with its own state: an abort hook set there never fires, a backend registered there is
    invisible to llama_model_load_from_file."""
    import llama_cpp  # noqa: F401  (loads libllama and, through its DT_NEEDED sonames, the ggml libraries)

    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rstrip("\n").split(maxsplit=5)[-1]
            if os.path.basename(path).startswith(stem + ".so"):
                return ctypes.CDLL(path)
    return ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", stem + ".so.0"))


def on_abort(report) -> None:
    """Call `report(message)` when ggml aborts the process (GGML_ASSERT, GGML_ABORT), instead of
    ggml's default print and gdb backtrace. The process still aborts after it returns."""
    global _ABORT_CB
    lib = ggml_library("libggml-base")
    proto = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
    lib.ggml_set_abort_callback.argtypes, lib.ggml_set_abort_callback.restype = [proto], ctypes.c_void_p

    def hook(message):
        report(message.decode("utf-8", "replace") if message else "ggml aborted")

    _ABORT_CB = proto(hook)
    lib.ggml_set_abort_callback(_ABORT_CB)


def abort(message: str) -> None:
    """ggml_abort, as a GGML_ASSERT would call it (tests of the abort path), in llama.cpp's own copy."""
    ggml_library("libggml-base").ggml_abort(b"injected", 0, b"%s", message.encode())


def constraint_tokenizer(vocab):
    """llguidance's tokenizer over a loaded llama_vocab (the structured-output masks index its tokens).
    Its builder still calls llama-cpp-python's deprecated llama_token_get_attr, once per token: silenced."""
    import warnings

    from llguidance.llamacpp import lltokenizer_from_vocab

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "llama_token_get_attr is deprecated", DeprecationWarning)
        return lltokenizer_from_vocab(vocab)


def row_bytes(n: int, ggml_type: int) -> int:
    blck, size = _TYPE_SIZE[ggml_type]
    return (n // blck) * size


def file_digest(path: str | os.PathLike, full_below: int = 1 << 30) -> str:
    """sha256 identifying a model file for the recipe fingerprint.

    Files under 1 GiB are hashed whole; bigger ones (real models of many GB) by
    their size and 64 evenly spaced 1 MiB blocks, so a node starts in seconds.
    """
    h = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < full_below:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            h.update(str(size).encode())
            for k in range(64):
                f.seek(k * (size - (1 << 20)) // 63)
                h.update(f.read(1 << 20))
    return h.hexdigest()


def version() -> str:
    import llama_cpp

    return llama_cpp.llama_version().decode()


def system_info() -> str:
    """llama.cpp's own build line: `... | LLAMAFILE = 1 | OPENMP = 1 | ...`."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode(errors="replace")


FLOAT_WEIGHTS = frozenset({"F16", "F32"})  # what AMX buffers hold without crashing (amx_crashes)


def amx_crashes() -> bool:
    """This llama.cpp's AMX kernels (CPUs with AMX_INT8) crash the process on the first matmul of 2 rows of
    quantized weights (SIGSEGV in ggml_backend_amx_mul_mat; llama.cpp issue #20824, open, no fix): quantized
    weights must not be moved into AMX buffers there, which llama.cpp does only with its extra buffer types
    on. Its f16 path (AVX-512 kernels) runs."""
    return "AMX_INT8 = 1" in system_info()


# weight formats whose logits the tests prove bitwise the same alone and in any crowd, stock build and patched
# (tests/test_determinism.py; docs/determinism.md); q4_K_M files hold Q4_K and Q6_K, Q4_1 ones Q4_1 and Q6_K or Q8_0
# (Q4_1 runs ggml_vec_dot at any width: no tinyBLAS kernel)
INVARIANT_WEIGHTS = frozenset({"F32", "F16", "Q8_0", "Q4_1", "Q4_K", "Q6_K"})


def matmul_weight_types(model_path: str) -> set[str]:
    """The formats of the weights the model multiplies by (the token embeddings are only looked up,
    unless the model ties them to the output)."""
    from meshnode.engine.ggufinfo import tensors

    table = tensors(model_path)
    tied = not any(t.name == "output.weight" for t in table)
    return {t.type_name for t in table if len(t.shape) == 2 and (t.name != "token_embd.weight" or tied)}


def deterministic_problem(model_path: str) -> str:
    """Why deterministic mode is refused for this model before loading it ("" if not), with the fix; the
    engine's start-up self-check (engine/invariant.py) judges the CPU and build."""
    return weights_problem(matmul_weight_types(model_path))


def weights_problem(weight_types: set[str]) -> str:
    """deterministic_problem, for weights whose formats are known already."""
    bad = weight_types - INVARIANT_WEIGHTS
    if bad:
        return (f"deterministic: not for {', '.join(sorted(bad))} weights, which no test here has proven "
                "batch-invariant; serve a file whose matrices are all F32, F16, Q8_0, Q4_1, Q4_K or Q6_K (meshnode "
                "make-model --quant q8_0, or llama-quantize; a q4_k_m file of a model whose rows are not a "
                "multiple of 256 falls back to other types), or run without deterministic mode")
    return ""


def recipe(model_path: str, type_k: str, type_v: str, flash_attn: str, n_batch: int, layout: str = "unified",
           deterministic: bool = False, placement: str = "", amx: bool = False) -> str:
    """Model identity plus every setting that changes numerics, never batch shape or threads. `placement`:
    the layers on offload devices (other kernels, other hosts), "" when all run on this CPU; `amx`: the
    weights in AMX buffers (other kernels than the same CPU's without them)."""
    parts = [file_digest(model_path), version(), type_k, type_v, flash_attn, str(n_batch), layout]
    if deterministic:  # the old fingerprints stay what they were
        parts.append("deterministic")
    if placement:
        parts.append(placement)
    if amx:
        parts.append("amx")
    parts += list(patches())  # other kernels, other bits (a stock build's fingerprints stay what they were)
    return "mn1-" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def vocab_difference(draft, target) -> str:
    """Why one llama_vocab's tokens are not another's ("" when they are): sizes, then every token's text."""
    import llama_cpp as lc

    n, m = lc.llama_vocab_n_tokens(draft), lc.llama_vocab_n_tokens(target)
    if n != m:
        return f"its vocab has {n} tokens, the model's {m}"
    text = lambda v, t: (lc.llama_vocab_get_text(v, t) or b"").decode("utf-8", "replace")  # noqa: E731
    bad = next((t for t in range(n) if text(draft, t) != text(target, t)), None)
    return "" if bad is None else f"token {bad} is {text(draft, bad)!r} there, {text(target, bad)!r} here"


def cannot_draft(path: str, why: str) -> str:
    return (f"draft_model: {path} cannot draft for this model: {why}; a draft model must share the model's "
            "tokenizer (the same family, another size or quantization)")


def load_model(path: str, params, who: str = ""):
    """llama_model_load_from_file, or FatalEngineError in llama.cpp's own words (`who`: whose model, for them)."""
    import llama_cpp as lc

    model = lc.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise FatalEngineError(f"{who}llama.cpp could not load {path}: {last_errors()}")
    return model


def new_context(owner, params, who: str = "") -> None:
    """`owner._ctx` on `owner._model` (llama_init_from_model), or FatalEngineError in llama.cpp's own words, the
    owner's model freed (free)."""
    import llama_cpp as lc

    owner._ctx = lc.llama_init_from_model(owner._model, params)
    if not owner._ctx:
        free(owner)
        raise FatalEngineError(f"{who}llama.cpp could not create a context: {last_errors() or 'no reason given'}")


def free(owner) -> None:
    """An engine's or draft model's llama.cpp context, then its model, freed once (each set to None)."""
    import llama_cpp as lc

    if getattr(owner, "_ctx", None):
        lc.llama_free(owner._ctx)
        owner._ctx = None
    if getattr(owner, "_model", None):
        lc.llama_model_free(owner._model)
        owner._model = None
