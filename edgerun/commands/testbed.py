"""`edgerun testbed up|down|status|run`: network namespaces with real kernel loss."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from edgerun.errors import EdgerunError

if TYPE_CHECKING:
    from edgerun.net.testbed import TestbedSpec
from edgerun.commands.common import one_share


def _testbed_spec(args: argparse.Namespace) -> TestbedSpec:
    from edgerun.net.testbed import TestbedSpec

    return TestbedSpec(nodes=args.nodes, loss=one_share(args.plr, "--plr"), delay_ms=args.delay,
                       rate_mbit=args.rate, cpu_quotas=tuple(args.cpu_quota or ()), name=args.name,
                       subnet=args.subnet)


def cmd_testbed_up(args: argparse.Namespace) -> None:
    from edgerun.net import testbed

    spec = testbed.up(_testbed_spec(args))
    print(f"testbed {spec.name}: master {spec.master_address} in namespace {spec.master_ns}")
    for k in range(1, spec.nodes + 1):
        quota = spec.cpu_quota(k)
        print(f"  node{k}: {spec.node_address(k)} in namespace {spec.node_ns(k)}"
              + ("" if quota is None else f", {quota:g} CPU cores"))
    rate = "unlimited" if spec.rate_mbit is None else f"{spec.rate_mbit:g} Mbit/s"
    print(f"every link, both directions: loss {spec.loss:.2%}, delay {spec.delay_ms:g} ms, rate {rate}")
    print(f"next: edgerun testbed run --name {spec.name} -- edgerun master --expect {spec.nodes} --prompt ...")


def cmd_testbed_down(args: argparse.Namespace) -> None:
    from edgerun.net import testbed

    for name in testbed.names() if args.all else [args.name]:
        removed = testbed.down(name)
        print(f"testbed {name}: removed {len(removed.namespaces)} namespaces, {len(removed.cgroups)} cgroups, "
              f"killed {removed.processes} processes")


def cmd_testbed_status(args: argparse.Namespace) -> None:
    from edgerun.net import testbed

    found = testbed.names() if args.name is None else [args.name]
    if not found:
        print("no testbed is up")
    for name in found:
        spec = testbed.load_spec(name)
        rate = "unlimited" if spec.rate_mbit is None else f"{spec.rate_mbit:g} Mbit/s"
        print(f"testbed {name}: {spec.nodes} nodes, loss {spec.loss:.2%}, delay {spec.delay_ms:g} ms, rate {rate}, "
              f"CPU quotas {list(spec.cpu_quotas) or 'none'}")
        print(f"  {'namespace':<22} {'device':<7} {'address':<15} {'qdiscs':<12} {'received':>9} {'dropped':>8}"
              f" {'loss':>7}")
        for r in testbed.status(spec):
            loss = f"{r.dropped / r.received:.2%}" if r.received else "-"
            print(f"  {r.namespace:<22} {r.device:<7} {r.address:<15} {','.join(r.qdiscs):<12} {r.received:>9} "
                  f"{r.dropped:>8} {loss:>7}")


def cmd_testbed_run(args: argparse.Namespace) -> None:
    import shlex
    import subprocess

    from edgerun.net import testbed

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        raise EdgerunError("give the command to run after --, for example: -- edgerun master --expect 3")
    spec = testbed.load_spec(args.name)

    def argv(words: list[str]) -> list[str]:
        # The edgerun of this interpreter, whatever PATH holds inside the namespace.
        return [sys.executable, "-m", "edgerun.cli", *words[1:]] if words[0] == "edgerun" else words

    where: str | int = args.inside
    if args.inside != "master":
        if not args.inside.startswith("node") or not args.inside[4:].isdigit():
            raise EdgerunError(f"--in takes master or nodeK, not {args.inside!r}")
        where = int(args.inside[4:])
    main = testbed.popen(spec, where, argv(command))
    nodes: list[subprocess.Popen] = []
    try:
        if args.inside == "master" and not args.no_nodes:
            deadline = time.monotonic() + args.wait
            while not testbed.listening(spec, args.port):
                if main.poll() is not None:
                    raise EdgerunError(f"{command[0]} exited ({main.returncode}) before listening on port "
                                       f"{args.port}")
                if time.monotonic() > deadline:
                    raise EdgerunError(f"nothing listens on port {args.port} of {spec.master_ns} after "
                                       f"{args.wait:g} s (is it the master's --port?)")
                time.sleep(0.2)
            for k in range(1, spec.nodes + 1):
                words = shlex.split(args.node_cmd.format(master=spec.master_address, port=args.port,
                                                         name=f"node{k}", index=k))
                nodes.append(testbed.popen(spec, k, argv(words)))
        code = main.wait()
    finally:
        for proc in [main, *nodes]:
            if proc.poll() is None:
                proc.terminate()
        for proc in [main, *nodes]:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if code != 0:
        raise SystemExit(code)


def _testbed_name_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default="edgerun", help="testbed name, prefix of its namespaces (default: edgerun)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    tb = sub.add_parser("testbed", help="network namespaces with real kernel packet loss, rate limits and CPU "
                        "quotas").add_subparsers(dest="testbed_command", required=True, metavar="SUBCOMMAND")
    p = tb.add_parser("up", help="create a testbed: a master namespace and one namespace per node",
                      description="Create namespace NAME-master (bridge br0, SUBNET.1) and NAME-node1..N (eth0, "
                                  "SUBNET.2..), linked by veth pairs. Every link, in both directions, loses --plr of "
                                  "its IP packets (nftables drops on the receiving side, counted), is limited to "
                                  "--rate (tbf) and delayed by --delay (netem, where the kernel has it). "
                                  "--cpu-quota runs nodes in cgroups with that many CPU cores. Needs root.")
    p.add_argument("--nodes", type=int, required=True, help="node namespaces (required)")
    p.add_argument("--plr", default="0", help="packet loss rate per link and direction: 5%% or 0.05 (default: 0)")
    p.add_argument("--delay", type=float, default=0.0, help="one-way delay in ms (needs sch_netem; default: 0)")
    p.add_argument("--rate", type=float, default=None, help="link rate in Mbit/s (default: unlimited)")
    p.add_argument("--cpu-quota", type=float, nargs="+", default=None, metavar="CORES",
                   help="CPU cores per node: one value for all, or one per node (0.5 = half a core; default: no limit)")
    p.add_argument("--subnet", default="10.77.0", help="first three numbers of the /24 (default: 10.77.0)")
    _testbed_name_arg(p)
    p.set_defaults(func=cmd_testbed_up)
    p = tb.add_parser("down", help="remove a testbed, also one left behind by a crash",
                      description="Kill the processes in the testbed's namespaces and cgroups, then delete its "
                                  "namespaces (with their links, qdiscs and nft tables), cgroups and state file.")
    _testbed_name_arg(p)
    p.add_argument("--all", action="store_true", help="every testbed with a state file")
    p.set_defaults(func=cmd_testbed_down)
    p = tb.add_parser("status", help="show testbeds and the loss the kernel has applied so far",
                      description="Per shaped interface: namespace, address, qdiscs, IP packets received and "
                                  "dropped, and the measured loss rate.")
    p.add_argument("--name", default=None, help="one testbed (default: all)")
    p.set_defaults(func=cmd_testbed_status)
    p = tb.add_parser("run", help="run a cluster in a testbed: CMD as master, one node per node namespace",
                      description="Start CMD in the master namespace; once something listens on --port there, "
                                  "start --node-cmd in every node namespace (under its CPU quota). When CMD ends "
                                  "the nodes are stopped, and CMD's exit code is returned. With --in, run CMD in "
                                  "one namespace only. A leading `edgerun` means this installation's edgerun.",
                      epilog="example: edgerun testbed run -- edgerun master --expect 3 --key S --prompt Hi "
                             "--node-cmd 'edgerun node --master {master}:{port} --name {name} --key S --threads 1'")
    _testbed_name_arg(p)
    p.add_argument("--port", type=int, default=7000, help="the master's TCP port (default: 7000)")
    p.add_argument("--node-cmd", default="edgerun node --master {master}:{port} --name {name} --threads 1",
                   help="node command; {master} {port} {name} {index} are filled in. The nodes share this "
                        "machine's cores: one compute thread each, as ggml's threads wait for one another between "
                        "operations and a process with more threads than free cores slows down many times "
                        "(default: %(default)s)")
    p.add_argument("--no-nodes", action="store_true", help="start no nodes")
    p.add_argument("--in", dest="inside", default="master", help="master or nodeK (default: master)")
    p.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the master (default: 300)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ...")
    p.set_defaults(func=cmd_testbed_run)
