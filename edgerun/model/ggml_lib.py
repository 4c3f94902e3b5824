"""ggml through `ggml-python`'s bindings: a CPU backend, a store of weights in ggml buffers, and graph contexts.

The one place edgerun touches ggml's C API: engines build their graphs with `ggml.ggml_*` ops on a
GraphContext and hold their tensors in a WeightStore.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.model.quant import QuantTensor

try:
    import ggml.ggml as ggml
except ImportError as e:  # ggml-python is a dependency: a broken install says so in one line
    raise EdgerunError(f"cannot load ggml (the ggml-python package): {e}") from e
except OSError as e:
    raise EdgerunError(f"cannot load ggml's shared libraries (reinstall ggml-python): {e}") from e


# ggml logs each tensor it repacks and each buffer it allocates on stderr: kept quiet (a reference to the callback
# is held for as long as ggml may call it).
_quiet = ggml.ggml_log_callback(lambda level, text, data: None)
ggml.ggml_log_set(_quiet, None)


def physical_cores() -> int:
    import psutil

    return psutil.cpu_count(logical=False) or psutil.cpu_count() or 1


def ggml_type(qtype: str) -> int:
    value = getattr(ggml, f"GGML_TYPE_{qtype}", None)
    if value is None:
        raise EdgerunError(f"ggml has no type {qtype}")
    return int(value)


def _extra_buffer_types(device: int) -> list[int]:
    """The CPU device's extra buffer types (repacked weights, AMX), in the order llama.cpp tries them."""
    reg = ggml.ggml_backend_dev_backend_reg(device)
    address = ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not address:
        return []
    get = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(address)
    found = get(device)
    out = []
    i = 0
    while found and found[i]:
        out.append(found[i])
        i += 1
    return out


class GgmlBackend:
    """ggml's CPU backend with its thread count, and the buffer types weights may live in."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or physical_cores()
        self.handle = ggml.ggml_backend_cpu_init()
        if not self.handle:
            raise EdgerunError("ggml's CPU backend did not start")
        ggml.ggml_backend_cpu_set_n_threads(self.handle, self.threads)
        self.device = ggml.ggml_backend_dev_by_type(ggml.GGML_BACKEND_DEVICE_TYPE_CPU)
        # (not ggml_backend_cpu_buffer_type: ggml-python declares its pointer a 32-bit int)
        self.buffer_type = ggml.ggml_backend_dev_buffer_type(self.device)
        self.extra_buffer_types = _extra_buffer_types(self.device)
        weakref.finalize(self, ggml.ggml_backend_free, self.handle)

    def weights(self) -> WeightStore:
        return WeightStore(self)


@dataclass
class _Pending:
    tensor: ggml.ggml_tensor_p
    data: np.ndarray | None  # None: zero-filled (a KV cache)


class WeightStore:
    """Tensors created by name, then uploaded at once: matrices the CPU's repacked kernels take go into that
    buffer type (which interleaves their blocks as they are set), everything else into plain CPU memory."""

    def __init__(self, backend: GgmlBackend) -> None:
        self.backend = backend
        self._contexts: dict[int, ggml.ggml_context_p] = {}
        self._tensors: list[ggml.ggml_tensor_p] = []
        self._pending: list[_Pending] = []
        self._buffers: list[int] = []
        self._probe_ctx = self._new_context(64)
        self._probe_buffers = {buft: ggml.ggml_backend_buft_alloc_buffer(buft, 0)
                               for buft in backend.extra_buffer_types}
        self.nbytes = 0

    @staticmethod
    def _new_context(n_tensors: int) -> ggml.ggml_context_p:
        params = ggml.ggml_init_params(mem_size=ggml.ggml_tensor_overhead() * n_tensors, mem_buffer=None,
                                       no_alloc=True)
        ctx = ggml.ggml_init(params)
        if not ctx:
            raise EdgerunError("ggml could not make a context")
        return ctx

    def _context(self, buft: int) -> ggml.ggml_context_p:
        if buft not in self._contexts:
            self._contexts[buft] = self._new_context(4096)
        return self._contexts[buft]

    def _buffer_type_for(self, qtype: int, cols: int, rows: int) -> int:
        """The first extra buffer type whose kernels take a product with this matrix (llama.cpp's rule)."""
        ctx = self._probe_ctx
        for buft in self.backend.extra_buffer_types:
            w = ggml.ggml_new_tensor_2d(ctx, qtype, cols, rows)
            w.contents.buffer = self._probe_buffers[buft]
            x = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, cols, 1)
            op = ggml.ggml_mul_mat(ctx, w, x)
            supported = ggml.ggml_backend_dev_supports_op(self.backend.device, op)
            w.contents.buffer = None
            ggml.ggml_reset(ctx)
            if supported:
                return buft
        return self.backend.buffer_type

    def add(self, name: str, value: QuantTensor | np.ndarray, repack: bool = True) -> int:
        """A weight tensor (a matrix in its file's type, or a float32 vector); returns its handle."""
        if isinstance(value, QuantTensor):
            qtype = ggml_type(value.qtype)
            rows, cols = value.shape
            buft = self._buffer_type_for(qtype, cols, rows) if repack else self.backend.buffer_type
            t = ggml.ggml_new_tensor_2d(self._context(buft), qtype, cols, rows)
            data = np.ascontiguousarray(value.raw)
        else:
            data = np.ascontiguousarray(value, np.float32)
            t = ggml.ggml_new_tensor_1d(self._context(self.backend.buffer_type), ggml.GGML_TYPE_F32, data.size)
        if data.nbytes != ggml.ggml_nbytes(t):
            raise EdgerunError(f"{name}: {data.nbytes} bytes do not fill ggml's {ggml.ggml_nbytes(t)}")
        ggml.ggml_set_name(t, name.encode())
        self._pending.append(_Pending(t, data))
        self._tensors.append(t)
        return len(self._tensors) - 1

    def cache(self, name: str, width: int, rows: int) -> int:
        """An F16 matrix of `rows` rows of `width` values, zeroed (a layer's K or V cache)."""
        t = ggml.ggml_new_tensor_2d(self._context(self.backend.buffer_type), ggml.GGML_TYPE_F16, width, rows)
        ggml.ggml_set_name(t, name.encode())
        self._pending.append(_Pending(t, None))
        self._tensors.append(t)
        return len(self._tensors) - 1

    def tensor(self, handle: int) -> ggml.ggml_tensor_p:
        return self._tensors[handle]

    def upload(self) -> None:
        """Allocate every context's buffer and copy the data in (a repacking buffer interleaves as it copies)."""
        for buft, ctx in self._contexts.items():
            buffer = ggml.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
            if not buffer:
                raise EdgerunError("ggml could not allocate the model's weights (out of memory?)")
            ggml.ggml_backend_buffer_clear(buffer, 0)
            self._buffers.append(buffer)
            self.nbytes += ggml.ggml_backend_buffer_get_size(buffer)
        for item in self._pending:
            if item.data is not None:
                ggml.ggml_backend_tensor_set(item.tensor, item.data.ctypes.data_as(ctypes.c_void_p), 0,
                                             item.data.nbytes)
        self._pending = []
        for buffer in self._buffers:
            weakref.finalize(self, ggml.ggml_backend_buffer_free, buffer)
        for ctx in [*self._contexts.values(), self._probe_ctx]:
            weakref.finalize(self, ggml.ggml_free, ctx)


class GraphContext:
    """One graph's tensors, its compute buffer and its inputs; built once, run many times."""

    def __init__(self, backend: GgmlBackend, max_nodes: int) -> None:
        self.backend = backend
        size = ggml.ggml_tensor_overhead() * (max_nodes + 16) + ggml.ggml_graph_overhead_custom(max_nodes, False)
        params = ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=True)
        self.ctx = ggml.ggml_init(params)
        if not self.ctx:
            raise EdgerunError("ggml could not make a graph context")
        weakref.finalize(self, ggml.ggml_free, self.ctx)
        self.graph = ggml.ggml_new_graph_custom(self.ctx, max_nodes, False)
        self.allocator = None

    def input(self, qtype: int, ne0: int, ne1: int | None = None) -> ggml.ggml_tensor_p:
        t = (ggml.ggml_new_tensor_1d(self.ctx, qtype, ne0) if ne1 is None
             else ggml.ggml_new_tensor_2d(self.ctx, qtype, ne0, ne1))
        ggml.ggml_set_input(t)
        return t

    def expand(self, t: ggml.ggml_tensor_p) -> None:
        ggml.ggml_build_forward_expand(self.graph, t)

    def allocate(self) -> None:
        self.allocator = ggml.ggml_gallocr_new(ggml.ggml_backend_get_default_buffer_type(self.backend.handle))
        weakref.finalize(self, ggml.ggml_gallocr_free, self.allocator)
        if not ggml.ggml_gallocr_alloc_graph(self.allocator, self.graph):
            raise EdgerunError("ggml could not allocate a graph's buffers (out of memory?)")

    @staticmethod
    def set(t: ggml.ggml_tensor_p, data: np.ndarray) -> None:
        ggml.ggml_backend_tensor_set(t, data.ctypes.data_as(ctypes.c_void_p), 0, data.nbytes)

    def compute(self) -> None:
        status = ggml.ggml_backend_graph_compute(self.backend.handle, self.graph)
        if status != ggml.GGML_STATUS_SUCCESS:
            raise EdgerunError(f"ggml's graph failed (status {status})")
