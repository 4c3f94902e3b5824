"""What `--plan` names: a tensor-parallel planner (a TPStrategy), "dp" (a pipeline: layer ranges on pipeline
workers, the DP planner) or "moe" (a mixture of experts' experts on expert workers). One list for every command.
Beside it, a tensor-parallel plan's unit mapping. Nothing heavy is imported here: every command's parser reads it."""

from __future__ import annotations

from enum import StrEnum

from edgerun.net.discovery import ClusterKind


class TPStrategy(StrEnum):
    """The tensor-parallel planners."""

    HALO = "halo"  # minmax_ratios within memory, then refined for the synchronizations (refine_counts)
    MINMAX = "minmax"  # minmax_ratios within memory
    GREEDY = "greedy"  # greedy_ratios within memory
    ILP = "ilp"  # an integer program (pulp)
    GALAXY = "galaxy"  # galaxy_ratios within memory
    EVEN = "even"  # equal shares, memory ignored (vanilla tensor parallelism)


class Mapping(StrEnum):
    """Which units of a layer go to which device."""

    INDEX = "index"  # in index order
    STATIC = "static"  # by the calibration's average importance, the most important on the most reliable devices
    DYNAMIC = "dynamic"  # ranked every block by the semantic-aware predictors


PIPELINE = "dp"
EXPERTS = "moe"
KIND_OF = {PIPELINE: ClusterKind.PP, EXPERTS: ClusterKind.MOE}


def plan_names(*kinds: ClusterKind) -> tuple[str, ...]:
    """The --plan values of a command that starts clusters of these kinds (tensor-parallel's planners first)."""
    names: tuple[str, ...] = tuple(TPStrategy) if ClusterKind.TP in kinds else ()
    return names + tuple(name for name, kind in KIND_OF.items() if kind in kinds)


def cluster_plan(name: str) -> tuple[ClusterKind, TPStrategy]:
    """A --plan value as the cluster kind it starts and its tensor-parallel planner (halo where it starts none)."""
    if name in KIND_OF:
        return KIND_OF[name], TPStrategy.HALO
    try:
        return ClusterKind.TP, TPStrategy(name)
    except ValueError:
        raise ValueError(f"unknown plan {name!r} (choose from {', '.join(plan_names(*ClusterKind))})") from None


def plan_name(kind: ClusterKind, strategy: TPStrategy) -> str:
    """The --plan value that starts this cluster (cluster_plan's inverse)."""
    return next((name for name, k in KIND_OF.items() if k is kind), str(strategy))
