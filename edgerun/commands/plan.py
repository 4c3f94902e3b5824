"""`edgerun plan`: plan who computes what, and preview it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from edgerun.errors import EdgerunError

if TYPE_CHECKING:
    pass
from edgerun.commands.common import model_arg
from edgerun.net.discovery import ClusterKind
from edgerun.sched.plans import cluster_plan, plan_names


def cmd_plan(args: argparse.Namespace) -> None:
    import dataclasses

    from edgerun.model.loader import load_model
    from edgerun.sched.pp_plan import CostParams, Pricing, plan_pp
    from edgerun.sched.preview import pp_table, tp_table
    from edgerun.sched.profiles import Link, load_devices, model_profile
    from edgerun.sched.tp_plan import InsufficientMemory, SyncModel, plan_tp

    devices = load_devices(args.devices)
    if args.plr:
        try:
            plrs = [float(x) for x in args.plr.split(",")]
        except ValueError as e:
            raise EdgerunError(f"--plr takes comma-separated numbers: {e}") from e
        if len(plrs) != len(devices) or not all(0 <= p <= 1 for p in plrs):
            raise EdgerunError(f"--plr needs {len(devices)} loss rates between 0 and 1, one per device")
        devices = [dataclasses.replace(d, link=Link(d.link.rtt_ms, d.link.up_mbit, d.link.down_mbit, p))
                   for d, p in zip(devices, plrs, strict=True)]
    if args.context < 1 or args.group_size < 1:
        raise EdgerunError("--context and --group-size must be positive")
    model = load_model(args.model)
    profile = model_profile(model.name, model.config, model.weights, context=args.context,
                            group_size=args.group_size)
    kind, strategy = cluster_plan(args.plan)
    if kind is ClusterKind.PP:
        plan = plan_pp(profile, devices, objective=args.objective, pricing=Pricing(args.pricing),
                       params=CostParams(include_init=args.init_cost))
        if not plan.complete:  # no table: a partial plan's prediction would read as a plan's
            budget = sum(d.memory.budget_mb for d in devices)
            need = sum(profile.layer_memory_bytes) / 1e6
            covered = plan.stages[-1].end_layer if plan.stages else 0
            fit = f"only layers 0-{covered - 1} fit" if covered else "not even layer 0 fits"
            raise EdgerunError(f"no pipeline covers the model: {fit}; the budgets total {budget:.1f} MB for "
                               f"{need:.1f} MB of layers")
        print(pp_table(plan, devices, profile))
    else:
        if args.master_device is not None:  # the master first: the planners take devices[0] as the master
            names = [d.name for d in devices]
            if args.master_device not in names:
                raise EdgerunError(f"--master-device {args.master_device!r} is none of the devices "
                                   f"({', '.join(names)})")
            devices.insert(0, devices.pop(names.index(args.master_device)))
        print(f"master: {devices[0].name}" + (" (the first --devices file; --master-device picks another)"
                                               if args.master_device is None else ""), file=sys.stderr)
        try:
            plan = plan_tp(profile, devices, strategy, sync=SyncModel(args.sync))
        except (InsufficientMemory, RuntimeError) as e:  # RuntimeError: the ILP found nothing in its time limit
            raise EdgerunError(str(e)) from e
        print(tp_table(plan, profile))
        if plan.oom_devices:
            raise EdgerunError(f"plan {args.plan} runs out of memory on {', '.join(o.name for o in plan.oom_devices)}")
        alone = [(plan_tp(profile, [d], "even", sync=SyncModel(args.sync)).time_per_token_s, d.name)
                 for d in devices if d.budget_bytes >= profile.total_tp_memory()]
        if alone and min(alone)[0] < plan.time_per_token_s:
            seconds, name = min(alone)
            print(f"warning: this plan is predicted at {plan.time_per_token_s * 1e3:.1f} ms/token, slower than "
                  f"{name} alone ({seconds * 1e3:.1f} ms/token): run the model there, or add faster devices",
                  file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(plan.to_json(), indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan who computes what, and preview it",
                       description="Solve a plan for a model over device profiles and print it as a table: per "
                                   "device its neuron groups (tensor-parallel) or layers (pipeline), memory used "
                                   "against its budget, predicted compute and communication time, and the "
                                   "predicted time per token. Tensor-parallel plans: halo (min-max ratios + "
                                   "PLR-aware mapping), minmax, greedy, ilp (exact, CBC), galaxy, even. Pipeline: "
                                   "dp (layer DP with worker-order search).")
    model_arg(p)
    p.add_argument("--master-device", default=None, metavar="NAME",
                   help="tensor-parallel: the device that runs the master (it also computes a share and looks "
                        "tokens up; default: the first --devices file's)")
    p.add_argument("--devices", type=Path, nargs="+", required=True, help="device profile JSON files, from `edgerun "
                   "profile --out` (required)")
    p.add_argument("--plan", choices=plan_names(ClusterKind.TP, ClusterKind.PP), default="halo",
                   help="planner (default: halo)")
    p.add_argument("--plr", default=None, help="override the devices' packet-loss rates, "
                   "comma-separated (default: the profiles' measured rates)")
    p.add_argument("--context", type=int, default=1024, help="tokens of KV cache to reserve (default: 1024)")
    p.add_argument("--group-size", type=int, default=256, help="MLP neuron-group size (default: 256)")
    p.add_argument("--sync", choices=("star", "per-device"), default="star",
                   help="tensor-parallel: how synchronizations are priced. star: as edgerun's master pays them, a "
                        "block lasting as long as its slowest device counting its session's fixed cost, a node its "
                        "round trip and the master its work per node (default, what `edgerun master` plans with); "
                        "per-device: HALO's Eq. (1), 2·L·(n-1) round trips per token")
    p.add_argument("--objective", choices=("sum", "max"), default="sum",
                   help="dp: sum (latency of one token, default) or max (throughput)")
    p.add_argument("--pricing", choices=("bytes", "macs"), default="bytes",
                   help="dp: what a layer costs: bytes, the weights a one-token step streams (default), or macs, its "
                        "multiply-adds, as `serve --parallel N` plans a batching pipeline (a batch's products are "
                        "compute-bound: an 8-bit LM head costs half what its bytes say against 4-bit layers)")
    p.add_argument("--init-cost", action="store_true",
                   help="dp: also weigh the time to download weights and start sessions, as a master does when it "
                        "first deploys (default: execution time only, the steady state)")
    p.add_argument("--out", type=Path, default=None, help="write the plan as JSON here (default: print "
                   "only)")
    p.set_defaults(func=cmd_plan)
