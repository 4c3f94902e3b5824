"""`edgerun profile`: measure this machine into a device profile."""

from __future__ import annotations

import datetime
import os
import platform
import socket
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil

from edgerun.memory import memory_read_bandwidth
from edgerun.sched.profiles import Compute, DeviceProfile, Link, Memory

Progress = Callable[[str], None]
# Without a master the link is this machine's own loopback: no latency, no loss.
LOOPBACK_LINK = Link(rtt_ms=0.0, up_mbit=10_000.0, down_mbit=10_000.0, loss_rate=0.0)


def detect_kind() -> str:
    model = Path("/proc/device-tree/model")
    if model.is_file():
        text = model.read_text(errors="ignore").lower()
        if "raspberry pi 5" in text:
            return "rpi5"
        if "raspberry pi 4" in text:
            return "rpi4"
        if "jetson" in text or "nvidia" in text:
            return "jetson"
    if Path("/etc/nv_tegra_release").exists():
        return "jetson"
    if Path("/proc/driver/nvidia/version").exists():
        return "gpu"
    return {"x86_64": "x86", "amd64": "x86", "aarch64": "arm64"}.get(platform.machine().lower(), "unknown")


def device_summary() -> str:
    """What a node tells its master it runs on, for people to read (the dashboard, `edgerun status`)."""
    return f"{detect_kind()}, {os.cpu_count() or 1} cores"


def matmul_gflops(seconds: float = 2.0, n: int = 512) -> float:
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = a.T.copy()
    a @ b  # first call allocates and spins up BLAS threads
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        runs += 1
    return 2 * n**3 * runs / (time.perf_counter() - start) / 1e9


def disk_read_mb_s(path: Path, limit_bytes: int = 256 * 1024 * 1024) -> float:
    """Read a file after asking the kernel to drop it from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        read, start = 0, time.perf_counter()
        while read < limit_bytes:
            chunk = os.read(fd, 4 * 1024 * 1024)
            if not chunk:
                break
            read += len(chunk)
        return read / (time.perf_counter() - start) / 1e6
    finally:
        os.close(fd)


def decode_speed(model_path: Path | None, threads: int, seconds: float) -> tuple[float, float, str]:
    """Weight bytes per second the onnx engine streams while decoding, the time per layer (ms),
    and the model measured."""
    from edgerun.model.generate import make_engine
    from edgerun.model.loader import load_model

    model = load_model(model_path)
    engine = make_engine("onnx", model, 512, threads=threads)
    engine.reset()
    token = int(engine.step(model.tokenizer.encode("The")).argmax())
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds and steps < 400:
        token = int(engine.step([token]).argmax())
        steps += 1
    per_token = (time.perf_counter() - start) / steps
    return engine.weight_bytes / per_token, per_token * 1000 / model.config.n_layers, model.name


def measure_device(*, name: str | None = None, model_path: Path | None = None, master: tuple[str, int] | None = None,
                   budget_mb: float | None = None, threads: int | None = None, seconds: float = 30.0,
                   progress: Progress = lambda _: None) -> DeviceProfile:
    """Measure compute, memory, disk and (with a master) the link; about `seconds` in all."""
    threads = threads or os.cpu_count() or 1
    sources: dict[str, str] = {}
    progress("memory bandwidth")
    bandwidth = memory_read_bandwidth(threads, size_mb=512, repeats=3)
    sources["memory.bandwidth_gb_s"] = f"numpy sums over 512 MB with {threads} threads"
    progress("matrix multiply")
    gflops = matmul_gflops(seconds * 0.1)
    sources["compute.matmul_gflops"] = "float32 512x512 matmul, numpy"
    progress("decode speed on the model")
    weight_rate, layer_ms, model_name = decode_speed(model_path, threads, seconds * 0.3)
    sources["compute.weight_bytes_per_s"] = f"onnx engine decode on {model_name}, {layer_ms:.3f} ms per layer"
    progress("disk read")
    from edgerun.model.loader import resolve_model_path

    disk = disk_read_mb_s(resolve_model_path(model_path))
    vm = psutil.virtual_memory()
    link = LOOPBACK_LINK
    if master:
        progress(f"link to {master[0]}:{master[1]}")
        from edgerun.net.probe import measure_link  # the network stack, only for a profile against a master

        m = measure_link(*master)
        link = Link(rtt_ms=m.rtt_ms, up_mbit=m.up_mbit, down_mbit=m.down_mbit, loss_rate=m.loss_rate)
        sources["link"] = f"{m.probes_sent} UDP echoes ({m.probes_lost} lost), 16 MB TCP each way"
    else:
        sources["link"] = "no master given: loopback"
    available_mb = vm.available / 1e6
    return DeviceProfile(
        name=name or socket.gethostname(),
        kind=detect_kind(),
        cores=os.cpu_count() or 1,
        compute=Compute(matmul_gflops=gflops, weight_bytes_per_s=weight_rate, layer_ms=layer_ms,
                        layer_model=model_name),
        memory=Memory(total_mb=vm.total / 1e6, available_mb=available_mb,
                      budget_mb=budget_mb if budget_mb is not None else 0.8 * available_mb,
                      bandwidth_gb_s=bandwidth / 1e9),
        link=link,
        disk_read_mb_s=disk,
        measured_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        sources=sources,
    )
