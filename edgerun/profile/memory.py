"""Memory-read bandwidth: what a bandwidth-bound decode step can hope for on this machine; peak RSS."""

from __future__ import annotations

import resource
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def memory_read_bandwidth(threads: int = 1, size_mb: int = 1024, repeats: int = 5) -> float:
    """Best-of-`repeats` bytes per second for `threads` threads each summing its own slice of an
    array far larger than the caches (numpy releases the GIL while it sums)."""
    data = np.ones(size_mb * 1024 * 1024 // 8, np.float64)
    chunks = np.array_split(data, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, chunks))  # first touch, outside the timing
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(np.sum, chunks))
            best = max(best, data.nbytes / (time.perf_counter() - start))
    return best


def peak_rss_mb() -> float:
    """This process's own peak RSS. ru_maxrss would do, but Linux carries it over from the parent across
    fork and exec; VmHWM belongs to the process's own address space."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
