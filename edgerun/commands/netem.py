"""`edgerun netem`: shape a real interface."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass
from edgerun.commands.common import one_share


def cmd_netem(args: argparse.Namespace) -> None:
    from edgerun.net import shaping

    if args.clear:
        tables = shaping.clear_loss(args.dev)
        qdisc = shaping.clear_qdiscs(args.dev)
        print(f"{args.dev}: removed {len(tables)} loss tables" + (" and the root qdisc" if qdisc else ""))
        return
    shape = shaping.LinkShape(one_share(args.loss, "--loss"), args.rate, args.delay)
    hooks = shaping.HOOKS if args.direction == "both" else (args.direction,)
    shaping.shape_link(args.dev, shape, hooks)
    print(f"{args.dev}: qdiscs {','.join(shaping.qdisc_kinds(args.dev))}; loss {shape.loss:.2%} on "
          f"{' and '.join(hooks)}; remove with: edgerun netem --dev {args.dev} --clear")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("netem", help="shape a real interface: loss, delay, rate (the master's link)",
                       description="Apply loss (nftables random drops, counted; on --direction), a rate limit "
                                   "(tbf) and a delay (netem, which some kernels lack) to a network interface "
                                   "of this machine, as HALO shapes the master's link; --clear removes them. "
                                   "Needs root.")
    p.add_argument("--dev", required=True, help="network interface, e.g. eth0 (required)")
    p.add_argument("--loss", default="0", help="packet loss rate: 5%% or 0.05 (default: 0)")
    p.add_argument("--delay", type=float, default=0.0, help="delay in ms (needs sch_netem; default: 0)")
    p.add_argument("--rate", type=float, default=None, help="rate in Mbit/s (default: unlimited)")
    p.add_argument("--direction", choices=("egress", "ingress", "both"), default="egress",
                   help="which packets are lost: sent (as netem would), received, or both (default: egress)")
    p.add_argument("--clear", action="store_true", help="remove what edgerun netem applied to --dev")
    p.set_defaults(func=cmd_netem)
