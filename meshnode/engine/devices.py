"""The devices llama.cpp spreads a model over: this host's CPU, GPUs of a GPU build, and ggml RPC servers
on other hosts (`meshnode rpc-worker`), which llama.cpp treats as devices like any GPU.

Everything goes through ggml's own backend registry, in the library copy llama.cpp loaded
(llamacpp.ggml_library): the protocol to other hosts is ggml's RPC protocol, never one of ours. An
RPC server that cannot be reached makes ggml abort the process mid-call, so the front checks that
every worker answers ggml's RPC hello (ipc/transport.py, `rpc_hello`) before it starts an engine that needs them.
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import replace

from meshnode.core.types import Device
from meshnode.engine import llamacpp

KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}  # enum ggml_backend_dev_type
MIB = 1 << 20
RPC_FIX = 'reinstall llama-cpp-python with RPC: tools/install-llama (README, "Set-up"; it builds with -DGGML_RPC=ON)'


class Registry:
    """ggml's backend registry, through ctypes: the functions the node needs, typed once."""

    def __init__(self):
        lib = self.lib = llamacpp.ggml_library("libggml")
        vp, cp, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
        for name, res, args in (("ggml_backend_reg_by_name", vp, [cp]),
                                ("ggml_backend_reg_get_proc_address", vp, [vp, cp]),
                                ("ggml_backend_register", None, [vp]),
                                ("ggml_backend_dev_count", sz, []), ("ggml_backend_dev_get", vp, [sz]),
                                ("ggml_backend_dev_by_name", vp, [cp]), ("ggml_backend_dev_by_type", vp, [ctypes.c_int]),
                                ("ggml_backend_dev_name", cp, [vp]), ("ggml_backend_dev_description", cp, [vp]),
                                ("ggml_backend_dev_type", ctypes.c_int, [vp]),
                                ("ggml_backend_dev_memory", None, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args

    def rpc_function(self, name: str, proto):
        reg = self.lib.ggml_backend_reg_by_name(b"RPC")
        if not reg:
            raise RuntimeError(f"this llama.cpp build has no RPC backend; {RPC_FIX}")
        return proto(self.lib.ggml_backend_reg_get_proc_address(reg, name.encode()))

    def add_rpc_server(self, endpoint: str) -> list[str]:
        """Register an RPC worker's devices; their names (RPC0, RPC1, ...). RuntimeError when it does not
        answer (ggml then reports no devices)."""
        add = self.rpc_function("ggml_backend_rpc_add_server", ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p))
        before = self.names()
        reg = add(endpoint.encode())
        if not reg:
            raise RuntimeError(f"rpc worker {endpoint} did not answer (is `meshnode rpc-worker` running there?)")
        self.lib.ggml_backend_register(reg)
        return [n for n in self.names() if n not in before]

    def names(self) -> list[str]:
        return [self.lib.ggml_backend_dev_name(self.lib.ggml_backend_dev_get(i)).decode()
                for i in range(self.lib.ggml_backend_dev_count())]

    def by_name(self, name: str) -> int:
        dev = self.lib.ggml_backend_dev_by_name(name.encode())
        if not dev:
            raise ValueError(f"device: llama.cpp has no device {name!r} (it has {', '.join(self.names())})")
        return dev

    def describe(self, name: str, endpoint: str = "") -> Device:
        dev = self.by_name(name)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        return Device(name, KINDS.get(self.lib.ggml_backend_dev_type(dev), "other"), endpoint, total.value,
                      free.value)

    def offload_devices(self) -> list[str]:
        """Devices llama.cpp offloads layers to by default: all but the CPU and its accelerators."""
        return [n for n in self.names() if self.describe(n).kind in ("gpu", "igpu")]

    def serve_rpc(self, endpoint: str, n_threads: int, devices: list[str], cache_dir: str | None = None) -> None:
        """ggml's RPC server on `devices` (default: this host's CPU): blocks, serving one client at a time,
        and returns only when it cannot listen."""
        start = self.rpc_function("ggml_backend_rpc_start_server", ctypes.CFUNCTYPE(
            None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)))
        devs = [self.by_name(n) for n in devices] or [self.lib.ggml_backend_dev_by_type(0)]
        arr = (ctypes.c_void_p * len(devs))(*devs)
        start(endpoint.encode(), cache_dir.encode() if cache_dir else None, n_threads, len(devs), arr)


_LAYER = re.compile(r"layer\s+(\d+) assigned to device (\S+?),")
_BUFFER = re.compile(r"(\S+)\s+(model|KV) buffer size =\s+([\d.]+) MiB")


def placed(devices: list[Device], lines: list[str]) -> list[Device]:
    """`devices` with the layers and buffers llama.cpp's load log put on each. A buffer is named after
    its device ("CPU_Mapped" is the CPU's, "RPC0[host:port]" the worker's at that endpoint); sizes are
    llama.cpp's, in its 0.01 MiB steps."""
    layers: dict[str, list[int]] = {}
    sizes: dict[tuple[str, str], float] = {}
    for line in lines:
        m = _LAYER.search(line)
        if m:
            layers.setdefault(m.group(2), []).append(int(m.group(1)))
            continue
        m = _BUFFER.search(line)
        if m:
            owner = _owner(m.group(1), devices)
            sizes[owner, m.group(2)] = sizes.get((owner, m.group(2)), 0.0) + float(m.group(3))
    return [replace(d, layers=tuple(sorted(layers.get(d.name, ()))), weight_bytes=int(sizes.get((d.name, "model"), 0) * MIB),
                    kv_bytes=int(sizes.get((d.name, "KV"), 0) * MIB)) for d in devices]


def _owner(buffer: str, devices: list[Device]) -> str:
    m = re.fullmatch(r"RPC(\d+)\[(.+)\]", buffer)  # the worker's own device index, and its endpoint
    if m:
        on_worker = [d.name for d in devices if d.endpoint == m.group(2)]
        return on_worker[int(m.group(1))] if int(m.group(1)) < len(on_worker) else buffer
    name = buffer.split("_")[0]
    return name if any(d.name == name for d in devices) else "CPU"  # host buffers of a GPU backend, repacks


class Placement:
    """What a model load was asked to put where: set on llama_model_params, kept alive (llama.cpp reads
    the arrays during the load) and read back from the load log."""

    def __init__(self, registry: Registry, listed: list[Device], keep: tuple = ()):
        self.registry, self.listed, self._keep = registry, listed, keep

    def placed(self, lines: list[str]) -> tuple[Device, ...]:
        """Every device with its layers and buffers; fresh memory figures (the KV is allocated now)."""
        fresh = [self.registry.describe(d.name, d.endpoint) for d in self.listed]
        return tuple(d for d in placed(fresh, lines) if d.layers or d.weight_bytes or d.kv_bytes or d.kind == "cpu")


def offload(mp, rpc: tuple[str, ...], gpu_layers: int | None, tensor_split: tuple[float, ...],
            names: tuple[str, ...]) -> Placement:
    """Set `mp` (llama_model_params) as llama-server would: RPC workers registered first (llama.cpp puts
    them before local GPUs), `gpu_layers` None = all layers on the offload devices there are, `names` the
    offload devices to use ("none": none), `tensor_split` their shares."""
    import llama_cpp as lc

    reg = Registry()
    if not (rpc or names or tensor_split or lc.llama_supports_gpu_offload()):
        mp.n_gpu_layers = 0  # a CPU build with nothing to offload to: as it always was
        return Placement(reg, [reg.describe("CPU")])
    if rpc and not lc.llama_supports_rpc():
        raise RuntimeError(f"--rpc needs llama.cpp's RPC backend, which this build lacks; {RPC_FIX}")
    endpoint = {}
    for ep in rpc:
        for name in reg.add_rpc_server(ep):
            endpoint[name] = ep
    chosen = [] if names == ("none",) else list(names) or [n for n in reg.names() if n in endpoint] + \
        [n for n in reg.offload_devices() if n not in endpoint]
    ptrs = (ctypes.c_void_p * (len(chosen) + 1))(*[reg.by_name(n) for n in chosen], None)
    mp.devices = ctypes.addressof(ptrs)  # a c_void_p field: the NULL-terminated ggml_backend_dev_t array
    mp.n_gpu_layers = -1 if gpu_layers is None else gpu_layers
    split = None
    if tensor_split:
        if len(tensor_split) > len(chosen):
            raise ValueError(f"tensor_split: {len(tensor_split)} shares for {len(chosen)} offload devices "
                             f"({', '.join(chosen) or 'none'})")
        split = (ctypes.c_float * lc.llama_max_devices())(*tensor_split)
        mp.tensor_split = ctypes.cast(split, ctypes.POINTER(ctypes.c_float))
    listed = [reg.describe("CPU")] + [reg.describe(n, endpoint.get(n, "")) for n in chosen]
    return Placement(reg, listed, (ptrs, split))


def fingerprint(devices: tuple[Device, ...]) -> str:
    """The recipe's part for offloaded layers: which layers on which kind of device where ("" when all
    are on this CPU, so a CPU node's recipe is what it always was)."""
    off = [d for d in devices if d.kind != "cpu" and d.layers]
    return ";".join(f"{d.kind}:{d.endpoint or d.name}:{','.join(map(str, d.layers))}" for d in off)
