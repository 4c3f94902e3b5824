"""`edgerun status` for a served master: the dashboard's state (/api/state) as text."""

from __future__ import annotations

import time
from typing import Any


def _num(value: float | None, digits: int = 1, unit: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{unit}"


def status_text(state: dict[str, Any]) -> str:
    measured = ", ".join(f"{mode} {ms:.1f}" for mode, ms in state["measured_ms_per_token"].items())
    lines = [f"serving {state['model']} from the {state['mode']} engine; single engine "
             f"{state['single_ms_per_token']:.1f} ms/token" + (f", measured {measured}" if measured else "")]
    plan = state["plan"]
    if plan is not None:
        lines.append(f"plan {plan['strategy']} over {', '.join(plan['devices'])}: predicted "
                     f"{plan['predicted_ms_per_token']:.1f} ms/token")
    lines.append(f"nodes: {sum(n['alive'] for n in state['nodes'])} alive" if state["nodes"] else "nodes: none")
    for n in state["nodes"]:
        holds = n["holds"]
        what = "nothing" if holds is None else (f"{holds['attention_units']} attention units, {holds['mlp_groups']} "
                                                f"MLP groups, {holds['vocab_blocks']} vocabulary blocks")
        loss = None if n["loss"] is None else 100 * n["loss"]
        lines.append(f"  {n['name']}: {n['kind']}, {n['state']}, {n['memory_mb']:.1f} / {n['budget_mb']:.0f} MB, "
                     f"{n['speed_gb_s']:.2f} GB/s, RTT {_num(n['rtt_ms'], 2)} ms, loss {_num(loss, 1, '%')}, "
                     f"holds {what}")
    queue = state["queue"]
    lines.append(f"queue: {queue['waiting']} request(s){', generating' if queue['busy'] else ''}; "
                 f"{sum(state['tokens_per_second'][-60:])} tokens in the last minute")
    lines.append(f"blocks {state['blocks']}, incomplete {state['blocks_incomplete']}, late packets "
                 f"{state['late_packets']}, recoveries {state['recoveries']}")
    if state["events"]:
        lines.append("recent events:")
        lines += [f"  {time.strftime('%H:%M:%S', time.localtime(e['at']))} {e['text']}" for e in state["events"][-10:]]
    return "\n".join(lines) + "\n"
