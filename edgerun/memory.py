"""This process's memory: peak RSS, huge pages for streamed weights, freed memory handed back, mapped model files let
go; and the memory-read bandwidth a bandwidth-bound decode step can hope for on this machine."""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

MADV_DONTNEED, MADV_HUGEPAGE, MADV_COLLAPSE = 4, 14, 25  # Linux (MADV_COLLAPSE: 6.1+)
HUGE_PAGE = 2 << 20  # x86-64's and arm64's transparent huge page
# Regions huge_pages() turns into huge pages: anonymous, writable, at least this large and this resident (a buffer
# mostly untouched, a KV cache or a thread's stack, would have its untouched pages made resident).
HUGE_MIN_BYTES = 4 << 20
HUGE_MIN_RESIDENT = 0.9


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
# Blocks this large or larger come from mmap and go back at once when freed; smaller ones stay on the heap, and its
# top is given back beyond TRIM_BYTES free
MMAP_BYTES, TRIM_BYTES = 2 << 20, 4 << 20


def return_freed_memory() -> None:
    """Have glibc hand large freed blocks back to the system at once. By default its threshold for serving an
    allocation from mmap rises to the largest block freed so far, so the buffers of a prefill (several MB each,
    freed when it ends) move onto the heap and stay resident there: 12-20 MB after each new prompt length on a
    1B share, which no malloc_trim gives back. Fixed thresholds keep a device's memory at its share's size.
    They are not set lower than a batch's block needs: a 64-token chunk's vectors of a 1B (the input, the
    partial, its frame: 512 KB each) then came from fresh mmaps each block, 128 page faults apiece, and took
    0.25-0.3 ms each to allocate and fill on a 2-core Xeon against 0.01-0.02 ms on the heap."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None)
    if hasattr(libc, "mallopt"):
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_BYTES)


def huge_pages() -> int:
    """Back this process's large, resident anonymous memory (the weights onnxruntime has repacked onto its heap)
    with transparent huge pages; the bytes now in huge pages. Where the system gives huge pages only to memory that
    asks for them (`madvise`, Debian's default), a share's weights sit in 4 KB pages: streaming them each token
    misses the TLB once a page, and the hardware prefetchers stop at every page's end. In huge pages a 1B share's
    kernels ran 11-17% faster on a 2-core AMD EPYC virtual machine (two copies of one share in one process,
    alternated token by token, 2 and 8 devices' shares), the whole-model engine's 8%; on a 16-core Xeon with 300 MB
    of L3, 1-2%. MADV_COLLAPSE (Linux 6.1+) moves the pages now, at about 0.7 GB/s; an older kernel only takes the
    advice, which its khugepaged follows over minutes. Nothing where the kernel has no transparent huge pages."""
    if not sys.platform.startswith("linux") or os.environ.get("EDGERUN_HUGE_PAGES") == "0":  # 0: 4 KB pages
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    collapsed = 0
    for first, last, huge in _anonymous_regions():
        if last - first <= huge:  # already in huge pages
            collapsed += huge
            continue
        address, size = ctypes.c_void_p(first), ctypes.c_size_t(last - first)
        if libc.madvise(address, size, MADV_HUGEPAGE) != 0:
            return collapsed  # no transparent huge pages here
        if libc.madvise(address, size, MADV_COLLAPSE) == 0:
            collapsed += last - first
    return collapsed


def _anonymous_regions() -> list[tuple[int, int, int]]:
    """The whole huge pages inside each private writable anonymous mapping of at least HUGE_MIN_BYTES,
    HUGE_MIN_RESIDENT of it resident, as (first, last) addresses aligned to HUGE_PAGE, with the mapping's bytes in
    huge pages already."""
    regions: list[tuple[int, int, int]] = []
    region: list | None = None  # [start, end, eligible, rss, huge] of the mapping being read

    def close() -> None:
        if region is not None and region[2] and region[3] >= HUGE_MIN_RESIDENT * (region[1] - region[0]):
            first, last = -(-region[0] // HUGE_PAGE) * HUGE_PAGE, region[1] // HUGE_PAGE * HUGE_PAGE
            if last > first:
                regions.append((first, last, region[4]))

    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if not fields:
            continue
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping: range perms offset dev inode path
            close()
            start, end = (int(v, 16) for v in fields[0].split("-"))
            anonymous = len(fields) == 5 or fields[5] == "[heap]"
            private_writable = fields[1].startswith("rw") and fields[1][3] == "p"
            eligible = private_writable and anonymous and end - start >= HUGE_MIN_BYTES
            region = [start, end, eligible, 0, 0]
        elif region is not None and fields[0] == "Rss:":
            region[3] = int(fields[1]) * 1024
        elif region is not None and fields[0] == "AnonHugePages:":
            region[4] = int(fields[1]) * 1024
    close()
    return regions


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
