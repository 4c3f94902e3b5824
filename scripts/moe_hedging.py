"""Seed 001 (MoEx) Table 1 and Table 3, by the latency model and, for Table 1, by measurement.

Table 1: the expected expert phase E[T_expert] for k = 8 experts per token, worker round trips log-normal with
median 20 ms and sigma 0.5, at hedging factors 1-4: integrating Eq. 18, and measured on a local MoEx cluster
(a hub and expert worker processes on loopback, every reply held back by a delay drawn from that distribution)
with a synthetic model routing 8 of 32 experts per token. The measured phase also holds the cluster's own
dispatch time (its base row, without injected latency), which the model column adds.

Table 3: per-token latency of Qwen3-30B-A3B (L = 48, hub attention 1.5 ms per layer, expert FFN 0.7 ms) by
Eqs. 10-12 with a one-way latency of RTT/2, and with each expert's round trip log-normal (sigma 0.5) around it,
hedged (Eq. 18), beside the MoEx paper's figures.

    python scripts/moe_hedging.py --out out/moe_hedging            # measured and modelled (about 2 minutes)
    python scripts/moe_hedging.py --out out/moe_hedging --model-only
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import asdict, replace
from pathlib import Path

from edgerun.sched.moe import LayerTimes, LogNormal, expected_expert_phase_ms, hedged_dispatch_ms, token_ms

SEED_TABLE1 = {1: 51.2, 2: 28.7, 3: 23.1, 4: 20.4}
SEED_TABLE3 = {"LAN": (0.5, {1: 163, 2: 150, 3: 146}), "WiFi (home)": (2.0, {1: 307, 2: 250, 3: 234}),
               "WAN (city)": (10.0, {1: 1075, 2: 922, 3: 874}), "WAN (cross)": (50.0, {1: 4915, 2: 4762, 3: 4714})}
LATENCY = LogNormal(20.0, 0.5)
K = 8


def table1_model() -> dict[int, float]:
    return {h: expected_expert_phase_ms(LATENCY, K, h) for h in SEED_TABLE1}


def table3_model() -> list[dict[str, object]]:
    rows = []
    for scenario, (rtt, seed) in SEED_TABLE3.items():
        times = LayerTimes(attn_ms=1.5, ffn_ms=0.7, net_ms=rtt / 2)
        row: dict[str, object] = {"scenario": scenario, "rtt_ms": rtt, "eq12_ms": token_ms(48, times)}
        for h in (1, 2, 3):
            row[f"h{h}_ms"] = token_ms(48, times, hedged_dispatch_ms(times, K, h, 0.5))
            row[f"seed_h{h}_ms"] = seed[h]
        rows.append(row)
    return rows


def measure(out: Path, tokens: int) -> list[dict[str, object]]:
    from edgerun.bench.moe import bench_moe
    from edgerun.model.loader import load_model
    from edgerun.model.synth import SHAPES, SynthSpec, write_synthetic

    path = out / "moe-k8.gguf"
    if not path.is_file():
        config = replace(SHAPES["moe-tiny"], n_experts=32, n_experts_used=8)
        write_synthetic(SynthSpec(config, "Q4_0"), path, "gguf")
    rows, _ = bench_moe(load_model(path), workers=8, replicas=4, hedges=[1, 2, 3, 4], latency=LATENCY,
                        tokens=tokens, progress=lambda m: print(f"{m}...", file=sys.stderr, flush=True))
    return [asdict(r) for r in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for the CSV, Markdown and PNG files")
    p.add_argument("--tokens", type=int, default=24, help="tokens generated per hedging factor (default: 24)")
    p.add_argument("--model-only", action="store_true", help="skip the measurement (default: measure too)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = table1_model()
    measured = [] if args.model_only else measure(args.out, args.tokens)
    by_hedge = {r["hedge"]: r for r in measured if r["latency"] != "none"}
    base = next((r["expert_mean_ms"] for r in measured if r["latency"] == "none"), 0.0)
    lines = ["# MoEx Table 1: expected expert phase, k = 8, log-normal(median 20 ms, sigma 0.5)", "",
             "| h | seed (ms) | model, Eq. 18 (ms) | measured mean (ms) | model + base (ms) | measured p99 (ms) |",
             "|---|---|---|---|---|---|"]
    with open(args.out / "table1.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["hedge", "seed_ms", "model_ms", "measured_mean_ms", "model_plus_base_ms", "measured_p99_ms"])
        for h, seed in SEED_TABLE1.items():
            row = by_hedge.get(h)
            cells = [h, seed, round(model[h], 2), row and round(row["expert_mean_ms"], 2),
                     row and round(base + model[h], 2), row and round(row["expert_p99_ms"], 2)]
            writer.writerow(cells)
            lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    lines += ["", f"Measured base (h = 1, no injected latency): {base:.2f} ms per layer." if measured else "",
              "The MoEx paper's h = 1 value (51.2) disagrees with its own Eq. 18, which integrates to the model "
              "column.",
              "", "# MoEx Table 3: Qwen3-30B-A3B per-token latency (ms), L = 48, attention 1.5 ms, FFN 0.7 ms", "",
              "| scenario | RTT | Eq. 12 | h=1 | h=2 | h=3 | seed h=1 | seed h=2 | seed h=3 |",
              "|---|---|---|---|---|---|---|---|---|"]
    table3 = table3_model()
    with open(args.out / "table3.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table3[0]))
        writer.writeheader()
        writer.writerows(table3)
    for r in table3:
        lines.append(f"| {r['scenario']} | {r['rtt_ms']} | {r['eq12_ms']:.0f} | {r['h1_ms']:.0f} | {r['h2_ms']:.0f} | "
                     f"{r['h3_ms']:.0f} | {r['seed_h1_ms']} | {r['seed_h2_ms']} | {r['seed_h3_ms']} |")
    lines += ["", "The MoEx paper's h = 1 column matches 48 x (1.5 + 2 x RTT + 0.7 + 0.2): a one-way latency of a "
              "whole RTT, counted twice per layer; Eq. 12 here takes RTT/2 each way."]
    (args.out / "tables.md").write_text("\n".join(lines) + "\n")
    _plot(args.out / "table1.png", model, by_hedge, base)
    print("\n".join(lines))


def _plot(path: Path, model: dict[int, float], measured: dict, base: float) -> None:
    try:
        import matplotlib
    except ImportError:
        print("(matplotlib is not installed: no PNG)", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    hs = list(model)
    ax.plot(hs, [SEED_TABLE1[h] for h in hs], "s--", label="seed Table 1")
    ax.plot(hs, [model[h] for h in hs], "o-", label="Eq. 18")
    if measured:
        ax.plot(hs, [measured[h]["expert_mean_ms"] - base for h in hs], "^-", label="measured - base")
    ax.set_xlabel("hedging factor h")
    ax.set_ylabel("expected expert phase (ms)")
    ax.set_xticks(hs)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
