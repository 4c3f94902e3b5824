"""Readable tables of plans, for `edgerun plan`: what will run where, before anything runs."""

from __future__ import annotations

from edgerun.sched.pp_plan import PPPlan
from edgerun.sched.profiles import SEND_S_PER_NODE, DeviceProfile, ModelProfile
from edgerun.sched.tp_plan import SyncModel, TPPlan
from edgerun.tables import Column, text_table


def _ranges(indices: tuple[int, ...]) -> str:
    """Compact 0-based index lists: (0, 1, 2, 5) -> "0-2,5"."""
    if not indices:
        return "-"
    parts, start, prev = [], indices[0], indices[0]
    for i in (*indices[1:], None):
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(parts)


def tp_table(plan: TPPlan, model: ModelProfile) -> str:
    """Per device: its units (layer 0's priority indices and totals), memory, compute and sync time."""
    counts = plan.counts()
    rows = [f"plan {plan.strategy} for {plan.model}: {len(plan.devices)} devices, {model.n_layers} layers, "
            f"{model.n_attn_units} attention units + {model.n_mlp_groups} MLP groups per layer, "
            f"{model.n_vocab_blocks} LM-head blocks"]
    rows += text_table((  # a row per device, by its index in the plan
        Column("device", lambda i: plan.devices[i], width=20, left=True),
        Column("PLR", lambda i: plan.plrs[i], ".3f", width=6),
        Column("attn (layer 0)", lambda i: _ranges(plan.attn[0][i])),
        Column("mlp (layer 0)", lambda i: _ranges(plan.mlp[0][i]), width=14),
        Column("head", lambda i: _ranges(plan.vocab[i]), width=9),
        Column("units", lambda i: sum(layer[i] for layer in counts.attn) + sum(layer[i] for layer in counts.mlp)
               + counts.vocab[i], width=6),
        Column("memory MB", lambda i: plan.memory_bytes[i] / 1e6, ".1f", width=10),
        Column("budget MB", lambda i: plan.budget_bytes[i] / 1e6, ".1f", width=10),
        Column("compute ms", lambda i: plan.compute_s[i] * 1e3, ".2f")), range(len(plan.devices)))
    nodes = sum(m > 0 for m in plan.memory_bytes[1:])  # devices[0] is the master
    if plan.sync == SyncModel.PER_DEVICE and plan.devices_used > 1:
        syncs = 2 * model.n_layers * (plan.devices_used - 1)
        sync = f"synchronization {plan.t_c_s * 1e3:.3f} ms x {syncs} per token (Eq. 1)"
    elif plan.sync == SyncModel.STAR and nodes:
        sync = (f"each of {2 * model.n_layers + 1} blocks per token: a node's round trip (up to "
                f"{plan.t_c_s * 1e3:.3f} ms) or the master's {nodes} x {SEND_S_PER_NODE * 1e6:.0f} us of sends "
                "on top of its compute, until it measures its own (star)")
    else:
        sync = "no synchronization (one device)"
    rows.append(f"{sync}; predicted {plan.time_per_token_s * 1e3:.2f} ms per token; solved in "
                f"{plan.solve_seconds * 1e3:.1f} ms" + (f", ILP {plan.ilp_status}" if plan.ilp_status else ""))
    for o in plan.oom_devices:
        rows.append(f"OUT OF MEMORY: {o.name} needs {o.needed_mb:.1f} MB, budget {o.budget_mb:.1f} MB")
    rows.append(f"memory: the units' weights and their KV cache for {model.context} tokens, "
                f"{model.total_tp_memory() / 1e6:.1f} MB in all; {plan.devices[0]}, the master, also looks tokens up "
                "in the embedding, read from the model file's pages and not counted")
    return "\n".join(rows)


def pp_table(plan: PPPlan, devices: list[DeviceProfile], model: ModelProfile) -> str:
    budgets = {d.name: d.memory.budget_mb for d in devices}
    memory = model.layer_memory_bytes
    rows = [f"plan dp ({plan.objective} objective, layers priced by {plan.pricing}) for {plan.model}: "
            f"{len(plan.stages)} stages over {len(devices)} devices, {plan.n_layers} layers; order found by "
            f"{plan.method} search"]
    rows += text_table((  # a row per stage, by its index
        Column("stage", lambda k: k),
        Column("device", lambda k: plan.stages[k].worker, width=20, left=True),
        Column("layers", lambda k: f"{plan.stages[k].first_layer}-{plan.stages[k].end_layer - 1}", width=9),
        Column("memory MB", lambda k: sum(memory[plan.stages[k].first_layer:plan.stages[k].end_layer]) / 1e6, ".1f",
               width=10),
        Column("budget MB", lambda k: budgets[plan.stages[k].worker], ".1f", width=10),
        Column("compute ms", lambda k: plan.stage_compute_s[k] * 1e3, ".2f"),
        Column("network ms", lambda k: plan.stage_network_s[k] * 1e3, ".2f")), range(len(plan.stages)))
    unused = [d.name for d in devices if d.name not in {s.worker for s in plan.stages}]
    if unused:
        rows.append(f"unused: {', '.join(unused)}")
    rows.append(f"predicted {plan.exec_s_per_token * 1e3:.2f} ms per token; solved in "
                f"{plan.solve_seconds * 1e3:.1f} ms")
    embedding = model.layer_weight_bytes[0] - model.layer_read_bytes[0]
    rows.append(f"memory: each stage's layers and their KV cache for {model.context} tokens, "
                f"{sum(memory) / 1e6:.1f} MB in all; the first stage also holds the embedding "
                f"({embedding / 1e6:.1f} MB, which a tensor-parallel plan does not count), the last the LM head")
    return "\n".join(rows)
