"""The least a tensor-parallel block exchange can cost in Python on this host: the floor under `bench tp`'s.

A master and N worker processes on loopback UDP, nothing else. For each block the master normalizes its hidden
state, seals it as one datagram (wire.seal: edgerun's header and GMAC) and sends it to every worker, streams its own
weight slice (a float32 matrix-vector product over a slice of its own, a different one each block, so the weights come
from memory as a share's do), then takes every worker's partial, checks it, sums and adds the residual. Each worker
polls its socket without sleeping, checks the input, streams its slice and sends its sealed partial back. There is no
loss handling, no deadline, no parity, no bookkeeping and no onnxruntime: what a block takes beyond the master's own
kernel here is what any star exchange written in Python pays on this host, its sends, its system calls, its caches
after a kernel and its slowest worker. Set against `bench tp --trace --ceiling`'s "beyond" figures, it says how much
of a cluster's synchronization is the exchange's own work and how much the host's.

    python scripts/star_floor.py --nodes 7 [--rows 400] [--blocks 600] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import numpy as np

SLICES = 32  # weight slices per process, used in turn: more than its caches hold
PARTIAL_TIMEOUT_S = 30.0  # a block whose partials have not all come by then has lost a worker
MAX_HIDDEN = 15_000  # float32 elements one datagram holds, with the header and MAC (loopback takes 64 KiB)


def _refuse(why: str) -> None:
    print(f"star_floor: {why}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=1, help="worker processes besides the master (default: 1)")
    p.add_argument("--rows", type=int, default=400,
                   help="rows of float32 weights (of --hidden columns) each process streams per block: 400 of 2048 "
                        "is 3.3 MB, about a 1B model's 8-device MLP share (default: 400)")
    p.add_argument("--hidden", type=int, default=2048, help="elements of the hidden state (default: 2048, a 1B model)")
    p.add_argument("--blocks", type=int, default=600, help="blocks timed (default: 600)")
    p.add_argument("--warmup", type=int, default=100, help="blocks run first, untimed (default: 100)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args()
    if args.nodes < 1 or args.rows < 1 or args.hidden < 1 or args.blocks < 1 or args.warmup < 0:
        _refuse("--nodes, --rows, --hidden and --blocks must be at least 1, --warmup at least 0")
    if args.hidden > MAX_HIDDEN:
        _refuse(f"--hidden must fit one datagram: at most {MAX_HIDDEN} float32 elements, not {args.hidden}")

    from threadpoolctl import threadpool_limits

    try:
        with threadpool_limits(1):  # one thread per process, as `bench tp --threads 1` runs
            result = run(args.nodes, args.rows, args.hidden, args.blocks, args.warmup)
    except (RuntimeError, TimeoutError) as e:
        print(f"star_floor: {e}", file=sys.stderr)
        sys.exit(1)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.nodes} worker(s), {args.rows} x {args.hidden} float32 weights a block each: block "
              f"{result['block_us']:.0f} µs (median; mean {result['block_mean_us']:.0f}), the master's own kernel "
              f"{result['kernel_us']:.0f} µs, beyond it {result['beyond_us']:.0f} µs")


def _udp() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    s.setblocking(False)
    return s


def _receive(sock: socket.socket, timeout_s: float | None = None) -> bytes:
    """The next datagram, polling without sleeping (as a spinning node waits for its input), and yielding the core
    to any process that has work for it (as net.channel's spin does where there are more processes than cores);
    TimeoutError after `timeout_s` (a worker that died sends nothing more)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            return sock.recv(65536)
        except BlockingIOError:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("a worker's partial did not come") from None
            os.sched_yield()


def _weights(seed: int, rows: int, hidden: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((SLICES, rows, hidden), np.float32)


def _worker(index: int, sock: socket.socket, master: tuple[str, int], rows: int, hidden: int, key: bytes) -> None:
    from edgerun.net.wire import Header, MsgType, open_packet, seal

    weights = _weights(index + 1, rows, hidden)
    while True:
        data = _receive(sock)
        if data == b"stop":
            return
        header, payload = open_packet(data, key)
        x = np.frombuffer(payload, np.float32)
        y = weights[header.position % SLICES] @ x
        partial = x * np.float32(1e-3)
        partial[:1] += y[:1]  # the product's first element: its result is used, as a kernel's is
        sock.sendto(seal(Header(MsgType.PARTIAL, 1, header.position, 0, 1, index), partial.tobytes(), key), master)


def run(nodes: int, rows: int, hidden: int, blocks: int, warmup: int) -> dict[str, float]:
    """Per block, in microseconds: the master's send-to-sum time (median, mean), its own kernel (median) and the
    difference of the medians."""
    from edgerun.net.wire import Header, MsgType, derive_key, open_packet, seal

    key = derive_key("star floor")
    master = _udp()
    workers = [_udp() for _ in range(nodes)]
    addresses = [w.getsockname() for w in workers]
    children = []
    for i, sock in enumerate(workers):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _worker(i, sock, master.getsockname(), rows, hidden, key)
            except BaseException:
                code = 1
            os._exit(code)
        children.append(pid)
    try:
        weights = _weights(0, rows, hidden)
        norm = np.ones(hidden, np.float32)
        x = np.random.default_rng(1).standard_normal(hidden).astype(np.float32)
        spans, kernels = [], []
        for block in range(warmup + blocks):
            started = time.perf_counter()
            normed = x * np.float32(1 / np.sqrt(np.mean(x * x) + 1e-5)) * norm
            datagram = seal(Header(MsgType.ACTIVATION, 1, block, 0, 1), normed.tobytes(), key)
            for address in addresses:
                master.sendto(datagram, address)
            kernel = time.perf_counter()
            y = weights[block % SLICES] @ normed
            total = normed * np.float32(1e-3)
            total[:1] += y[:1]
            computed = time.perf_counter()
            for _ in range(nodes):
                _, payload = open_packet(_receive(master, PARTIAL_TIMEOUT_S), key)
                total += np.frombuffer(payload, np.float32)
            x = x + total - normed  # the residual, kept in range
            ended = time.perf_counter()
            if block >= warmup:
                spans.append(ended - started)
                kernels.append(computed - kernel)
    finally:
        for address in addresses:
            master.sendto(b"stop", address)
        failed = sum(os.waitpid(pid, 0)[1] != 0 for pid in children)
    if failed:
        raise RuntimeError(f"{failed} worker(s) failed")
    block_us, kernel_us = statistics.median(spans) * 1e6, statistics.median(kernels) * 1e6
    return {"nodes": nodes, "rows": rows, "block_us": block_us, "block_mean_us": statistics.fmean(spans) * 1e6,
            "kernel_us": kernel_us, "beyond_us": block_us - kernel_us}


if __name__ == "__main__":
    main()
