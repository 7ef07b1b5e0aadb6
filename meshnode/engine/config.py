"""What one engine runs: every setting the llama.cpp context is built from, and the rules between them.

It has no defaults of its own: NodeConfig.resolve() (meshnode/ops/config.py) is the one place that
derives each value from the node's settings, so an engine started by the node, a benchmark or a test
runs what that would give, and the two processes never disagree about a default. The rules here are
the ones that need llama.cpp or the model file (weights, RPC support); single values are range- and
choice-checked where they are declared, once.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

from meshnode.core.budget import deterministic_rows_problem, rows_problem
from meshnode.core.endpoints import host_port
from meshnode.engine import devices, invariant, llamacpp
from meshnode.engine.llamacpp import QUANTIZED_KV

AMX_MAX_ROWS = 4  # the most sequences (rows a tick) for which f16 weights go to AMX buffers: see extra_buffers


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    n_seq_max: int  # llama.cpp sequence slots
    n_ctx: int  # KV cells in all (on streams, n_ctx / n_seq_max each)
    n_batch: int  # most tokens one tick may carry
    max_rows: int  # most decode rows (sequences) one tick may carry: the front's max_batch
    n_threads: int  # 0 = all cores
    type_k: str
    type_v: str
    flash_attn: str  # llama.cpp's flash attention computes in f16 on CPU: "off" for f32 numerics
    kv_layout: str  # "unified": one pool for all sequences, or "streams": n_ctx / n_seq_max cells each
    # a sequence's numbers independent of its neighbours (docs/determinism.md): True required (refused where it
    # cannot hold), None wherever it holds (else off, saying why), False off
    deterministic: bool | None
    # llama.cpp's devices (meshnode/engine/devices.py), with llama-server's meanings: RPC workers (HOST:PORT),
    # layers offloaded (None = all there are devices for), each offload device's share, which devices ("none")
    rpc: tuple[str, ...]
    gpu_layers: int | None
    tensor_split: tuple[float, ...]
    devices: tuple[str, ...]
    # speculative decoding (meshnode/engine/drafts.py): off, lookup (always the most drafts a lookup finds),
    # auto (as many as the cost model expects to pay, core/speculation.py); at most draft_max drafts a
    # sequence a tick, none where fewer than draft_min would pay (llama-server's --spec-draft-n-max/-min)
    spec: str
    draft_model: str  # a GGUF with this model's tokenizer that drafts (engine/draftmodel.py); "" = none
    draft_max: int
    draft_min: int
    # ticks may be hurried (the priority policy, core/priority.py: a better request's first token waits): each
    # llama_decode runs with llama.cpp's abort callback, a Python call between graph nodes; off, none is set
    hurry: bool

    @cached_property
    def deterministic_problem(self) -> str:
        """Why deterministic mode cannot run with this configuration and model ("" when it may, pending the
        engine's start-up check), in one line with the fix."""
        if self.kv_layout != "streams":
            return ("deterministic: needs kv_layout = \"streams\" (in one unified pool a sequence's cells land "
                    "where its neighbours leave room, and attention depends on where)")
        if self.flash_attn == "off":
            return ("deterministic: needs flash attention (flash_attn auto or on): without it re-prefilled KV is "
                    "computed by other kernels than decoded KV")
        if self.n_seq_max < 2:
            return "deterministic: needs n_seq_max >= 2 (a lone row is padded with a row on another stream)"
        return deterministic_rows_problem(self.n_batch, self.max_rows) or llamacpp.weights_problem(self.weight_types)

    @cached_property
    def deterministic_cost(self) -> str:
        """Why the default (deterministic unset) leaves the mode off where it could hold: it would make a session
        decoding alone slower (engine/invariant.py, lone_cost); "" where it is free or was set."""
        if self.deterministic is not None or self.deterministic_problem:
            return ""
        why = invariant.lone_cost(self.weight_types, self.type_k, self.type_v,
                                  self.amx_eligible and self.weight_types == {"F16"}, self.threads,
                                  llamacpp.split_kv_switch())
        return f"deterministic: off by default: {why}" if why else ""

    @cached_property
    def weight_types(self) -> set[str]:
        """The formats of the weights the model multiplies by (read from the file once; empty before it exists)."""
        return llamacpp.matmul_weight_types(self.model_path) if os.path.isfile(self.model_path) else set()

    @property
    def wants_deterministic(self) -> bool:
        return self.deterministic is True or (self.deterministic is None and not self.deterministic_problem
                                              and not self.deterministic_cost)

    @property
    def extra_buffers(self) -> bool:
        """Whether llama.cpp may move the weights into its extra buffer types (repacked layouts, AMX). Off:
        - in deterministic mode, where repacked quantized weights run one kernel for a single row and another
          for several; the exceptions give a row the same bits in any crowd, even alone (the engine's self-check
          and tests/test_determinism.py hold them): AMX's f16 path, and q8_0 on a build with patches/'s x86
          kernels (llamacpp.invariant_repack);
        - on AMX CPUs for quantized weights, which crash this llama.cpp (llamacpp.amx_crashes), and for f16
          weights where a tick may carry more than AMX_MAX_ROWS rows: AMX's f16 kernel is faster for a few
          rows and slower for more than tinyBLAS is (docs/determinism.md, item 6)."""
        if llamacpp.amx_crashes():
            return self.amx_eligible
        return not self.wants_deterministic or llamacpp.invariant_repack(self.weight_types)

    @property
    def threads(self) -> int:
        """The threads llama.cpp runs on (n_threads, or every core)."""
        return self.n_threads or os.cpu_count() or 1

    @property
    def amx_eligible(self) -> bool:
        """Weights that go to AMX buffers in either mode (see extra_buffers)."""
        return (llamacpp.amx_crashes() and self.n_seq_max <= AMX_MAX_ROWS and bool(self.weight_types)
                and self.weight_types <= llamacpp.FLOAT_WEIGHTS)

    @property
    def amx_weights(self) -> bool:
        """The weights go to AMX buffers: other kernels (the recipe says so), and for f16 ones a lone row's bits."""
        return self.extra_buffers and llamacpp.amx_crashes()

    @property
    def flash(self) -> str:
        """What llama.cpp is asked for: deterministic mode needs flash attention on (without it a decode
        row's attention and a prompt chunk's take different kernels, so re-prefilled KV differs)."""
        return "on" if self.wants_deterministic else self.flash_attn

    def validate(self, need_file: bool = True) -> None:
        """The rules between values that llama.cpp would refuse or assert on, in the words of the config keys."""
        if need_file and not os.path.isfile(self.model_path):
            raise FileNotFoundError(f"model file not found: {self.model_path}")
        why = rows_problem(self.n_batch, self.n_ctx, self.n_seq_max, self.max_rows)
        if why:
            raise ValueError(why)
        if self.type_v in QUANTIZED_KV and self.flash == "off":
            raise ValueError(f"type_v: a {self.type_v} V cache needs flash attention (flash_attn auto or on)")
        if self.spec == "draft" and not self.draft_model:
            raise ValueError("spec: draft needs a draft model (draft_model, --draft-model PATH)")
        if need_file and self.draft_model and not os.path.isfile(self.draft_model):
            raise FileNotFoundError(f"draft model file not found: {self.draft_model}")
        if self.draft_min > self.draft_max:
            raise ValueError(f"draft_min and draft_max: need draft_min <= draft_max, got {self.draft_min} and "
                             f"{self.draft_max}")
        if self.deterministic is True and self.deterministic_problem:
            raise ValueError(self.deterministic_problem)
        if any(x < 0 for x in self.tensor_split) or (self.tensor_split and not sum(self.tensor_split) > 0):
            raise ValueError(f"tensor_split: proportions >= 0 with a positive sum, got {list(self.tensor_split)}")
        for ep in self.rpc:
            host_port(ep)  # ValueError naming it
        if self.rpc and not llamacpp.supports_rpc():
            raise ValueError(f"rpc: this llama.cpp build has no RPC backend; {devices.RPC_FIX}")
        if self.devices == ("none",) and self.rpc:
            raise ValueError("device: none leaves the rpc workers unused; name the devices or drop --rpc")

    def recipe(self, deterministic: bool | None = None, placement: str = "") -> str:
        """The fingerprint of what this configuration computes, without loading anything (`deterministic`:
        whether the mode is in effect, if known; else whether it is wanted; `placement`: which layers run
        on which offload device, once loaded)."""
        det = self.wants_deterministic if deterministic is None else deterministic
        return llamacpp.recipe(self.model_path, self.type_k, self.type_v, self.flash, self.n_batch, self.kv_layout, det,
                               placement, amx=self.amx_weights)
