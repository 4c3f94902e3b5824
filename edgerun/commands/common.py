"""What several subcommands share: common options, the cluster key, parsing helpers."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from edgerun.errors import EdgerunError

NODE_SPEED = 1e9  # a node's declared speed without --speed or --profile, weight bytes/s
NODE_BUDGET_MB = 2048.0  # a node's memory budget without --memory-budget or --profile
DEFAULT_THREADS = os.cpu_count() or 1


def model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None,
                   help="a GGUF file or a Hugging Face directory (default: the shipped SmolLM2-135M-Instruct)")


def thread_count(text: str) -> int:
    """--threads: a whole number of at least 1 (0 threads made onnxruntime pick its own count, and numpy's split
    raised a ValueError)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a whole number of threads, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=thread_count, default=DEFAULT_THREADS,
                   help=f"compute threads of the engine, ggml's or onnxruntime's (default: {DEFAULT_THREADS}, this "
                        "machine's cores)")


def limit_blas_threads(threads: int) -> None:
    """Cap numpy's BLAS threads: several processes on one machine, each spinning a thread per core,
    slow each other down."""
    from threadpoolctl import threadpool_limits

    if threads < 1:
        raise EdgerunError(f"--threads must be at least 1, not {threads}")
    threadpool_limits(threads)


def parity_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parity", type=int, default=2, metavar="FRAGMENTS",
                   help="parity fragments sent after a one-datagram vector over UDP, 0 to 4; a vector cut into "
                        "several datagrams gets one more for every two of them, at most 4 (wire.parity_fragments: a "
                        "1B model's float32 vector, six datagrams at Ethernet's MTU, gets 4 with any value from 1). A "
                        "receiver rebuilds as many lost fragments of the vector from them (an erasure code; a "
                        "one-datagram vector's are copies of it). At 5%% loss a two-datagram vector is lost 9.75%% "
                        "of the time with 0, 0.048%% with 1 (two parity fragments: three of its four datagrams "
                        "lost), 0.003%% with 2 and 0.0002%% with 3 (default: 2). Sent on a node's link once it has "
                        "lost a packet, or measured loss when the node joined: a clean link carries none")
    p.add_argument("--no-parity", dest="parity", action="store_const", const=0,
                   help="same as --parity 0 (default: off)")
    p.add_argument("--parity-always", action="store_true",
                   help="send the parity fragments on every link from the start, lossy or not (default: off)")


def udp_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout-ms", type=float, default=10.0, help="UDP merge timeout (default: 10, as HALO)")
    p.add_argument("--adaptive-timeout", action="store_true",
                   help="learn the timeout from each node's arrival times and lag behind its peers")
    p.add_argument("--timeout-deviations", type=float, default=4.0,
                   help="adaptive timeout: give up on a partial k mean deviations after its expected time (default: "
                        "4, as TCP; smaller waits less for lost packets and drops more late ones)")
    parity_arg(p)


def activations_arg(p: argparse.ArgumentParser) -> None:
    # The values of model.onnx_graph.Activations, spelt out: this module loads for every command, onnx does not.
    p.add_argument("--activations", choices=("int8", "f32"), default="int8",
                   help="activations of the quantized matrix products on every device: int8 quantizes each "
                        "32-element block as llama.cpp does (1.4x the speed of float32 at one thread on the shipped "
                        "model); f32 keeps float32 (the numpy reference's numbers to rounding). Browser tabs on "
                        "edgerun's kernels compute in int8, tabs on onnxruntime-web in float32 (default: int8)")


ROUTE_HELP = ("chain: the master sends each pass to the first stage, each stage hands its output straight to the "
              "next, the last returns the token (one hop per stage plus one; stages with replicas and browser tabs, "
              "which cannot accept connections, make a plan fall back to star); star: every stage's input and "
              "output go through the master")


def route_arg(p: argparse.ArgumentParser) -> None:
    # The values of pp.deployment.Route, spelt out: this module loads for every command, the pipeline does not.
    p.add_argument("--route", choices=("chain", "star"), default="chain",
                   help=f"with --plan dp, how passes go through the stages: {ROUTE_HELP} (default: chain)")


def spin_arg(p: argparse.ArgumentParser, auto: bool = False) -> None:
    """--spin-us; `auto` (benchmarks, which start every process on this machine): the default is auto."""
    what = ("after the last message, keep polling for the next one this many microseconds before sleeping "
            "(tensor-parallel: the UDP socket, and on the master the generation's next step; pipeline: the pass port "
            "and the event loop): a sleeping process can "
            "take hundreds of microseconds to wake for a packet on virtual machines, several times a block's "
            "compute, once per block or stage on every token's path. Holds a core while generating: use it where "
            "each process has a core of its own")
    if auto:
        p.add_argument("--spin-us", type=spin_value, default=None, metavar="US|auto",
                       help=f"{what}; auto: 20000 where this machine has a core for every compute thread of the "
                            "run's processes, else 0 (default: auto)")
    else:
        p.add_argument("--spin-us", type=microseconds, default=0.0, metavar="US", help=f"{what} (default: 0, off)")


def spin_value(text: str) -> float | None:
    """--spin-us of a benchmark: microseconds, or None for auto."""
    return None if text == "auto" else microseconds(text, " or auto")


def microseconds(text: str, alternative: str = "") -> float:
    """--spin-us: a time of 0 microseconds or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes microseconds{alternative}, not {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or more microseconds, not {text}")
    return value


def rto_min_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tcp-rto-min-ms", type=float, default=None,
                   help="minimum TCP retransmission timeout of the reliable channel, Linux 6.15+ (default: 5 with "
                        "--transport udp, where TCP carries per-token traffic; the kernel's 200 with tcp, as "
                        "distributed-llama; 0: the kernel's)")


def share_threads_arg(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument("--threads", type=thread_count, default=default,
                   help=f"compute threads per process: ggml's or onnxruntime's for the tensor-parallel share or "
                        f"pipeline stage, and numpy's. Processes that share a machine's cores (a master and nodes "
                        f"on one computer) should together use no more threads than it has cores: ggml's threads "
                        f"wait for one another between operations, and one without a free core slows its whole "
                        f"process many times (default: {default})")


def blas_threads_arg(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument("--threads", type=thread_count, default=default,
                   help=f"numpy (BLAS) threads per process (default: {default})")


def host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EdgerunError(f"expected HOST:PORT, not {text!r}")
    return host, int(port)


def config_dir() -> Path:
    """edgerun's own settings: $EDGERUN_CONFIG, else ~/.config/edgerun."""
    return Path(os.environ.get("EDGERUN_CONFIG") or Path.home() / ".config" / "edgerun")


def stored_secret(make: bool) -> str | None:
    """The cluster secret kept in the config folder (cluster.key, readable by its owner only); made on first use
    where `make` (`edgerun serve` without --key), else None where there is none."""
    path = config_dir() / "cluster.key"
    kept = path.read_text().strip() if path.exists() else ""
    if kept or not make:
        return kept or None
    import secrets

    path.parent.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_urlsafe(18)
    temporary = path.with_name(f".cluster.key.{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    try:  # two servers started at once: the first one's key is kept, the second reads it
        os.link(temporary, path)
    except FileExistsError:
        if path.read_text().strip():
            return path.read_text().strip()
        os.replace(temporary, path)  # an empty file: replaced
    finally:
        temporary.unlink(missing_ok=True)
    print(f"edgerun: made a cluster key, kept in {path} (nodes on other machines need it as --key)", file=sys.stderr)
    return secret


def cluster_secret(args: argparse.Namespace, make: bool = False) -> str | None:
    """The cluster secret: --key, $EDGERUN_KEY, or the one kept in the config folder (made there on first use
    where `make`)."""
    return args.key or os.environ.get("EDGERUN_KEY") or stored_secret(make)


def cluster_key(args: argparse.Namespace, make: bool = False) -> bytes:
    from edgerun.net.wire import derive_key

    secret = cluster_secret(args, make)
    if not secret:
        print(f"edgerun: warning: no --key, $EDGERUN_KEY or {config_dir() / 'cluster.key'}: packets are checked, "
              "but anyone can forge them, and a master that has a key refuses this node", file=sys.stderr)
    return derive_key(secret)


def loss_arg(args: argparse.Namespace):
    from edgerun.net.loss import parse_loss

    try:
        return parse_loss(args.loss, seed=args.loss_seed)
    except ValueError as e:
        raise EdgerunError(f"--loss: {e}") from e


def shares(text: str, name: str) -> list[float]:
    """Comma-separated shares: 0.05 or 5%."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            value = float(item[:-1]) / 100 if item.endswith("%") else float(item)
        except ValueError:
            raise EdgerunError(f"{name} takes shares such as 0.05 or 5%, not {item!r}") from None
        if not 0.0 <= value <= 1.0:
            raise EdgerunError(f"{name}: {item} is not a share between 0 and 1")
        out.append(value)
    if not out:
        raise EdgerunError(f"{name} is empty")
    return out


def progress_line(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def one_share(text: str, name: str) -> float:
    values = shares(text, name)
    if len(values) != 1:
        raise EdgerunError(f"{name} takes one share such as 5% or 0.05, not {text!r}")
    return values[0]


def overlap_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overlap", default="pred",
                   help="dynamic mapping's overlap (HALO Fig. 5): pred (rank the next layer while partials travel) "
                        "or none. HALO's Load-with-Comp overlap has nothing to hide here: every device holds every "
                        "unit's weights in its kernels' form and a step picks its units inside the graph "
                        "(default: pred)")


def overlaps(text: str) -> tuple[str, ...]:
    from edgerun.tp.config import OVERLAPS

    chosen = tuple(x.strip() for x in text.split(",") if x.strip() and x.strip() != "none")
    for x in chosen:
        if x not in OVERLAPS:
            raise EdgerunError(f"--overlap takes {', '.join(OVERLAPS)} or none, not {x!r}")
    return chosen


def key_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--key", default=None, help="cluster secret that authenticates every packet "
                   "(default: $EDGERUN_KEY, else the key `edgerun serve` keeps in ~/.config/edgerun/cluster.key)")


def cluster_args(p: argparse.ArgumentParser) -> None:
    key_arg(p)
    p.add_argument("--loss", default="0", help="in-process packet loss on this side's UDP sends: 5%%, "
                   "bernoulli:0.05, ge:0.05[:burst] (Gilbert-Elliott bursts); default 0")
    p.add_argument("--loss-seed", type=int, default=None, help="seed for --loss (default: a random one)")


def sampling_args(p: argparse.ArgumentParser, whose: str = "") -> None:
    """--temperature, --top-k, --top-p, --min-p, --seed and --greedy, defaulting to USER_DEFAULTS. `whose`: a
    phrase after "sampling" in the group's title (the API's defaults for `serve`)."""
    from edgerun.model.sampling import USER_DEFAULTS as d

    g = p.add_argument_group(f"sampling{whose}", "llama.cpp's server defaults; the same request and seed give the "
                             "same text")
    g.add_argument("--temperature", type=float, default=d.temperature,
                   help=f"higher is more random, 0 is greedy (default: {d.temperature:g})")
    g.add_argument("--top-k", type=int, default=d.top_k,
                   help=f"draw among the k most likely tokens, 0 for all (default: {d.top_k})")
    g.add_argument("--top-p", type=float, default=d.top_p, help="draw among the most likely tokens whose "
                   f"probabilities sum to p (default: {d.top_p:g})")
    g.add_argument("--min-p", type=float, default=d.min_p, help="drop tokens less than this fraction as likely "
                   f"as the most likely one, 0 for none (default: {d.min_p:g})")
    g.add_argument("--seed", type=int, default=d.seed, help=f"the draws' seed (default: {d.seed})")
    g.add_argument("--greedy", action="store_true",
                   help="always the most likely token, as --temperature 0 (default: off)")


def sampling_params(args: argparse.Namespace):
    """The SamplingParams of sampling_args' options; a bad value is one line."""
    from edgerun.model.sampling import SamplingParams

    try:
        return SamplingParams(0.0 if args.greedy else args.temperature, args.top_k, args.top_p, args.seed,
                              args.min_p)
    except ValueError as e:
        raise EdgerunError(str(e)) from e
