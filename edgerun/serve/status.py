"""`edgerun status` for a served master: the dashboard's state (/api/state) as text."""

from __future__ import annotations

import time
from typing import Any


def _num(value: float | None, digits: int = 1, unit: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{unit}"


def status_text(state: dict[str, Any]) -> str:
    measured = ", ".join(f"{mode} {ms:.1f}" for mode, ms in state["measured_ms_per_token"].items())
    single = "no single engine" if state["single_ms_per_token"] is None else \
        f"single engine {state['single_ms_per_token']:.1f} ms/token"
    serving = "waiting for nodes (no capacity)" if state["mode"] == "none" else f"from the {state['mode']} engine"
    plan = state["plan"]
    if state["mode"] == "cluster" and plan is not None and plan.get("memory_mb") and \
            not any(m > 0 for m in plan["memory_mb"][1:]):
        serving += " (the master alone: its plan leaves every node out)"
    lines = [f"serving {state['model']} {serving}; {single}" + (f", measured {measured}" if measured else ""),
             f"master: {state['device']}"]
    if plan is not None:
        # A mixture of experts' placement predicts no time a token: its plan says where the experts are.
        predicted = plan.get("predicted_ms_per_token")
        # Only the devices that compute: a plan may leave nodes out (they cost more than they would compute).
        memory = plan.get("memory_mb") or [1.0] * len(plan["devices"])
        used = [d for d, m in zip(plan["devices"], memory, strict=True) if m > 0]
        left = [d for d, m in zip(plan["devices"], memory, strict=True) if m <= 0]
        lines.append(f"plan {plan['strategy']} over {', '.join(used) or 'no device'}"
                     + (f" (left out: {', '.join(left)})" if left else "")
                     + ("" if predicted is None else f": predicted {predicted:.1f} ms/token"))
    lines.append(f"nodes: {sum(n['alive'] for n in state['nodes'])} alive" if state["nodes"] else "nodes: none")
    for n in state["nodes"]:
        loss = None if n["loss"] is None else 100 * n["loss"]
        device = f" ({n['device']})" if n.get("device") else ""
        lines.append(f"  {n['name']}: {n['kind']}{device}, {n['state']}, {_num(n['memory_mb'])} / "
                     f"{_num(n['budget_mb'], 0)} MB, {_num(n['speed_gb_s'], 2)} GB/s, RTT {_num(n['rtt_ms'], 2)} ms, "
                     f"loss {_num(loss, 1, '%')}, "
                     f"holds {n['holds'] or 'nothing'}")
    queue = state["queue"]
    generating = f", {queue.get('running', 1)} generating" if queue["busy"] else ""  # (older servers: no count)
    at_once = f" ({queue['parallel']} at once)" if queue.get("parallel", 1) > 1 else ""
    lines.append(f"queue: {queue['waiting']} request(s){generating}{at_once}; "
                 f"{sum(state['tokens_per_second'][-60:])} tokens in the last minute")
    lines.append(f"blocks {state['blocks']}, incomplete {state['blocks_incomplete']}, late packets "
                 f"{state['late_packets']}, recoveries {state['recoveries']}")
    if state["events"]:
        lines.append("recent events:")
        lines += [f"  {time.strftime('%H:%M:%S', time.localtime(e['at']))} {e['text']}" for e in state["events"][-10:]]
    return "\n".join(lines) + "\n"
