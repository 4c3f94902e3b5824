"""Memory-read bandwidth: what a bandwidth-bound decode step can hope for on this machine; peak RSS."""

from __future__ import annotations

import contextlib
import ctypes
import resource
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

MADV_DONTNEED = 4  # Linux


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


def reset_peak_rss() -> None:
    """Start this process's peak RSS (VmHWM) afresh from what it holds now (Linux: clear_refs "5"), so a device
    that drops one share for another reports the peak of the share it holds, not of one it let go of. Elsewhere,
    or where /proc does not allow it, the peak stays the lifetime's."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def return_freed_memory() -> None:
    """Have glibc hand large freed blocks back to the system at once. By default its threshold for serving an
    allocation from mmap rises to the largest block freed so far, so the buffers of a prefill (several MB each,
    freed when it ends) move onto the heap and stay resident there: 12-20 MB after each new prompt length on a
    1B share, which no malloc_trim gives back. Fixed thresholds keep a device's memory at its share's size."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None)
    if hasattr(libc, "mallopt"):
        libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
        libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024)


def release_mapped_files(paths: Iterable[Path]) -> None:
    """Let go of this process's resident pages of memory-mapped files and of freed heap. A tensor-parallel share
    is copied out of the model file into its kernels' own buffers; the file's pages it read on the way (every row
    of a column-sliced matrix) would otherwise stay resident, counted in the process's memory, though the share
    never reads them again. The mapping stays valid: a page touched again comes back from the file."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    targets = {str(Path(path).resolve()) for path in paths}
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() in targets:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)
    if hasattr(libc, "malloc_trim"):  # glibc: return freed heap (the share's build temporaries) to the system
        libc.malloc_trim(0)
