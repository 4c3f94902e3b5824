"""onnxruntime sessions of stage graphs: their options and providers, and StageSession, which runs a layer range
with its KV cache bound in place. Imports onnxruntime and numpy only, so a pipeline worker starts without the
graph builder (onnx) or the GGUF reader."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgerun.errors import EdgerunError
from edgerun.memory import huge_pages
from edgerun.model.config import ModelConfig, kv_names


def session_options(threads: int | None) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    if threads:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return so


@functools.cache
def _register_shared_arena() -> None:
    """The process's one CPU arena, registered with onnxruntime's environment (once: it refuses a second)."""
    memory = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    # Extended by what is asked, not to the next power of two: its size follows the largest block's buffers.
    ort.create_and_register_allocator(memory, ort.OrtArenaCfg({"max_mem": 0, "arena_extend_strategy": 1}))


def share_cpu_arena(options: ort.SessionOptions) -> None:
    """Have the session made with these options allocate its buffers from the process's one CPU arena, shared by
    every session that does so. Many small sessions run one after another (a tensor-parallel share's blocks):
    each one's own arena would keep its peak for good (100-250 MB in all on a 1B share), and no arena at all maps
    every buffer of 128 KB or more afresh where malloc's thresholds are fixed (a node's), so each block
    page-faults its prefill buffers again. One arena holds what the largest block needs at once: a half 1B
    share's prefill kernels ran 10-25% faster and its decode 5-8%, for 8 MB more resident."""
    _register_shared_arena()
    options.add_session_config_entry("session.use_env_allocators", "1")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())


# Whether this onnxruntime creates sessions on several threads at once (StageSession in parts): 1.32 releases the
# GIL while it builds one (two sessions of a 1B stage on two threads: 670-780 ms against 1270-1580 one after the
# other); 1.30 holds it (1330-1540 against 1320-1540), and parts would only add session calls.
CONCURRENT_SESSIONS = _version(ort.__version__) >= (1, 32)


DEVICES = ("auto", "cpu", "cuda")


def execution_providers(device: str = "cpu") -> list[str]:
    """onnxruntime's providers for a device: "cuda" needs the onnxruntime-gpu package (its CUDA provider),
    "auto" takes CUDA where that package offers it and the CPU otherwise."""
    if device not in DEVICES:
        raise EdgerunError(f"unknown device {device!r} ({', '.join(DEVICES)})")
    has_cuda = "CUDAExecutionProvider" in ort.get_available_providers()
    if device == "cuda" and not has_cuda:
        raise EdgerunError("--device cuda needs onnxruntime-gpu, whose CUDA provider this onnxruntime lacks "
                           f"(it offers {', '.join(ort.get_available_providers())})")
    if device != "cpu" and has_cuda:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def part_dirs(graph_dir: Path, bounds: Sequence[int]) -> list[Path]:
    """The graph directories of a stage in parts: its own directory for a stage in one part, else one
    subdirectory per part, named 0, 1, ... (`bounds`: the layers where parts after the first begin)."""
    return [Path(graph_dir)] if not bounds else [Path(graph_dir) / str(i) for i in range(len(bounds) + 1)]


class _Part:
    """One graph of a stage: an onnxruntime session over a contiguous run of the stage's layers."""

    def __init__(self, graph_dir: Path, layers: range, threads: int | None, providers: Sequence[str]) -> None:
        self.layers = layers
        self.session = ort.InferenceSession(str(graph_dir / "model.onnx"), session_options(threads),
                                            providers=list(providers))
        self.input_name = self.session.get_inputs()[0].name  # "input_ids" or "hidden"
        self.output_name = self.session.get_outputs()[0].name  # "logits" or "hidden_out"
        self.binding = self.session.io_binding()


class StageSession:
    """One stage (a layer range) in onnxruntime, with its layers' KV buffers bound as both past and present, so
    the attention kernel appends in place. Used whole by OnnxEngine and per stage by pipeline workers.

    A stage may come as several graphs over consecutive runs of its layers (`bounds`: where the parts after the
    first begin), run one after the other. Their sessions are created at once on as many threads: a session's
    creation is mostly onnxruntime repacking its weights on one thread, so a stage in k parts loads up to k
    times faster where k cores are free (CONCURRENT_SESSIONS), which is what a pipeline waits for when a worker
    replaces a lost one. Each further part is one more session call per pass."""

    def __init__(self, graph_dir: Path, config: ModelConfig, first_layer: int, end_layer: int, max_len: int,
                 threads: int | None = None, providers: Sequence[str] = ("CPUExecutionProvider",),
                 bounds: Sequence[int] = ()) -> None:
        self.config, self.layers, self.max_len = config, range(first_layer, end_layer), max_len
        edges = [first_layer, *bounds, end_layer]
        if any(a >= b for a, b in itertools.pairwise(edges)):
            raise ValueError(f"parts {edges} do not split layers {first_layer}-{end_layer - 1}")
        runs = [range(a, b) for a, b in itertools.pairwise(edges)]
        dirs = part_dirs(graph_dir, bounds)
        # With CUDA the KV buffers stay in host memory, bound as on the CPU; onnxruntime copies them.
        if len(runs) == 1:
            self.parts = [_Part(dirs[0], runs[0], threads, providers)]
        else:
            with ThreadPoolExecutor(len(runs)) as pool:  # creation releases the GIL
                self.parts = list(pool.map(lambda d, r: _Part(d, r, threads, providers), dirs, runs))
        self.input_name = self.parts[0].input_name
        self.kv: dict[str, np.ndarray] = {}  # the bound KV buffers (onnxruntime shares their memory)
        self.prefix: tuple[int, dict[str, np.ndarray]] | None = None  # a saved prefix's length and KV rows
        self.bound = False  # KV buffers of its own are bound (reset makes them when not)
        self.reset()
        huge_pages()  # the weights the kernels repacked, streamed every token (edgerun.memory.huge_pages)

    def reset(self) -> None:
        """Forget every cached position. The KV buffers stay bound as they are: attention reads only the positions
        cached (seqlens_k), never what a buffer holds past them, so a request starts without allocating, binding
        and page-faulting fresh buffers (2-3 ms a request on the shipped model's 30 layers)."""
        self.position = 0
        if self.bound:
            return
        c = self.config
        shape = (1, c.n_kv_heads, self.max_len, c.head_dim)
        for part in self.parts:
            part.binding = part.session.io_binding()
            part.binding.bind_output(part.output_name)  # first, so it is output 0
            for i in part.layers:
                past_k, past_v, present_k, present_v = kv_names(i)
                for past, present in ((past_k, present_k), (past_v, present_v)):
                    self.kv[past] = np.zeros(shape, np.float32)
                    buffer = ort.OrtValue.ortvalue_from_numpy(self.kv[past])
                    part.binding.bind_ortvalue_input(past, buffer)
                    part.binding.bind_ortvalue_output(present, buffer)
        self.bound = True

    def warm_up(self) -> None:
        """Run one position and forget it: a session's first run allocates what later runs reuse, which would
        otherwise fall on the first real token (a hot swap's, the moment it is timed)."""
        x = np.zeros((1, 1), np.int64) if self.input_name == "input_ids" else \
            np.zeros((1, 1, self.config.hidden), np.float32)
        self.run(x)
        self.reset()

    def save_prefix(self) -> None:
        """Keep the KV rows of every position cached so far (a shared prompt prefix)."""
        self.prefix = (self.position, {name: a[:, :, :self.position].copy() for name, a in self.kv.items()})

    def restore_prefix(self) -> int:
        """Continue from the saved prefix, whatever ran since; returns its length."""
        if self.prefix is None:
            raise ValueError("no prefix saved")
        length, rows = self.prefix
        for name, a in self.kv.items():
            a[:, :, :length] = rows[name]
        self.position = length
        return length

    def adopt_kv(self, other: StageSession, layer: int) -> None:
        """Take over another session's KV buffers of one layer, cached rows and all, without copying them (a
        worker swapping stages keeps the layers both hold); the other session must not run again."""
        if layer not in self.layers or layer not in other.layers or other.max_len != self.max_len:
            raise ValueError(f"layer {layer}'s KV buffers do not fit this stage")
        binding = next(part.binding for part in self.parts if layer in part.layers)
        past_k, past_v, present_k, present_v = kv_names(layer)
        for past, present in ((past_k, present_k), (past_v, present_v)):
            self.kv[past] = other.kv[past]
            buffer = ort.OrtValue.ortvalue_from_numpy(self.kv[past])
            binding.bind_ortvalue_input(past, buffer)
            binding.bind_ortvalue_output(present, buffer)
        self.position = other.position
        other.bound = False  # should it run after all, its next reset takes buffers of its own, not these

    def kv_rows(self, layer: int, since: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """One layer's keys and values of the positions cached from `since` on, (1, kv heads, positions, head
        dim) each."""
        past_k, past_v, _, _ = kv_names(layer)
        end = self.position  # read once: keys and values of the same rows, whatever runs meanwhile
        if layer not in self.layers or not 0 <= since <= end:
            raise ValueError(f"no KV rows of layer {layer} from position {since} here")
        return (np.ascontiguousarray(self.kv[past_k][:, :, since:end]),
                np.ascontiguousarray(self.kv[past_v][:, :, since:end]))

    def load_kv_rows(self, layer: int, keys: np.ndarray, values: np.ndarray, since: int = 0) -> None:
        """Continue after these keys and values of one layer (another session's kv_rows from `since` on, the
        rows before it loaded already): once every layer of the stage is loaded, the next run starts after
        them."""
        past_k, past_v, _, _ = kv_names(layer)
        length = keys.shape[2] if keys.ndim == 4 else -1
        expected = (1, self.config.n_kv_heads, length, self.config.head_dim)
        if layer not in self.layers or keys.shape != expected or values.shape != expected or since < 0 or \
                since + length > self.max_len:
            raise ValueError(f"KV rows {keys.shape} from position {since} for layer {layer} do not fit this stage")
        self.kv[past_k][:, :, since:since + length] = keys
        self.kv[past_v][:, :, since:since + length] = values
        self.position = since + length

    def run(self, x: np.ndarray) -> np.ndarray:
        """Run token ids (1, seq) or hidden states (1, seq, hidden) after the positions cached; return
        the stage's output (a copy: onnxruntime reuses its buffer)."""
        total = self.position + x.shape[1]
        if total > self.max_len:
            raise ValueError(f"context of {self.max_len} tokens exceeded")
        dtype = np.int64 if self.input_name == "input_ids" else np.float32
        x = np.ascontiguousarray(x, dtype)
        seqlens_k, total_seq_len = np.array([total - 1], np.int32), np.array(total, np.int32)
        for part in self.parts:
            b = part.binding
            b.bind_cpu_input(part.input_name, x)
            b.bind_cpu_input("seqlens_k", seqlens_k)
            b.bind_cpu_input("total_seq_len", total_seq_len)
            b.bind_output(part.output_name)  # allocated per run: its shape follows the step's length
            part.session.run_with_iobinding(b)
            x = b.get_outputs()[0].numpy()  # the next part's input (this part runs again only on the next pass)
        self.position = total
        return x.copy()
