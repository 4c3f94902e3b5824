"""Clusters with a GPU member against the CPU engine: their greedy tokens, and how fast they ran.

Runs, on one machine with an NVIDIA GPU and nvcc (ggml's CUDA backend is built once):
  - the single engine on the CPU and on the GPU;
  - a tensor-parallel cluster: this process as master (CPU) and --nodes node processes, the first on the GPU;
  - a pipeline: --workers worker processes, the first on the GPU, the others on the CPU;
and prints each one's greedy tokens' agreement with the CPU engine's (a GPU adds in another order, so a near-tie
may go the other way and the texts part from there) and its ms per token. Example:

    python scripts/gpu_clusters.py --model /tmp/1b.gguf --tokens 32 --nodes 1 --workers 2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from edgerun.bench.pp import local_pipeline, stage_budgets_mb
from edgerun.bench.tp import TpBenchConfig, _rebalance, local_cluster
from edgerun.model.generate import generate, make_engine
from edgerun.model.loader import load_model
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.sched.profiles import model_profile

PROMPT = "Distributed inference splits one model across several machines because"
CONTEXT = 512


def agreement(tokens: list[int], want: list[int]) -> str:
    same = next((i for i, (a, b) in enumerate(zip(tokens, want, strict=True)) if a != b), len(want))
    return f"first {same} of {len(want)} tokens equal, {sum(a == b for a, b in zip(tokens, want, strict=True))} in all"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the shipped model)")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per run (default: 32)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of every process (default: 1)")
    p.add_argument("--nodes", type=int, default=1, help="tensor-parallel node processes, the first on the GPU "
                   "(default: 1)")
    p.add_argument("--workers", type=int, default=2, help="pipeline workers, the first on the GPU (default: 2)")
    args = p.parse_args()
    model = load_model(args.model)
    prompt = model.tokenizer.encode(PROMPT)
    greedy = Sampler(SamplingParams())

    def timed(run) -> tuple[list[int], float]:
        run()  # warm-up: graphs built, caches touched
        start = time.perf_counter()
        tokens = run()
        return tokens, (time.perf_counter() - start) * 1e3 / args.tokens

    # The GPU first: a process that loaded ggml's CPU-only build cannot load its CUDA build (which has the CPU's).
    gpu = make_engine("ggml", model, CONTEXT, threads=args.threads, device="cuda")
    on_gpu, gpu_ms = timed(lambda: generate(gpu, prompt, args.tokens, greedy).tokens)
    cpu = make_engine("ggml", model, CONTEXT, threads=args.threads)
    want, ms = timed(lambda: generate(cpu, prompt, args.tokens, greedy).tokens)
    print(f"single engine, CPU ({args.threads} thread(s)): {ms:.1f} ms/token")
    print(f"single engine, GPU: {gpu_ms:.1f} ms/token; {agreement(on_gpu, want)}")

    config = TpBenchConfig(args.model, tokens=args.tokens, threads=args.threads, gpu_nodes=1)
    with local_cluster(model, config, args.nodes, "0") as master:
        master.replan()
        _rebalance(master, model)  # the speeds the devices showed: the GPU node takes the share they call for
        tokens, ms = timed(lambda: master.generate(prompt, args.tokens, greedy))
        shares = ", ".join(f"{d} {m / 1e6:.0f} MB" for d, m in zip(master.plan.devices, master.plan.memory_bytes,
                                                                    strict=True))
        print(f"tensor-parallel, master (CPU) + {args.nodes} node(s), the first on the GPU: {ms:.1f} ms/token; "
              f"{agreement(tokens, want)}; shares {shares}")

    layers = model_profile(model.name, model.config, model.weights, context=CONTEXT).layer_memory_bytes
    budgets = [stage_budgets_mb(layers, args.workers)] * args.workers
    with local_pipeline(model, budgets, CONTEXT, threads=args.threads, gpu_workers=1) as (master, _):
        plan = master.start()
        tokens, ms = timed(lambda: master.generate(prompt, args.tokens))
        devices = {name: master.workers[name].capabilities.device for name in master.workers}
        stages = ", ".join(f"{s.worker} ({devices.get(s.worker)}) layers {s.first_layer}-{s.end_layer - 1}"
                           for s in plan.stages)
        print(f"pipeline, {args.workers} worker(s), the first on the GPU: {ms:.1f} ms/token; "
              f"{agreement(tokens, want)}; stages {stages}")


if __name__ == "__main__":
    main()
