"""What to tell a user whose model fits no layout of the ranks asked for: each layout weighed,
on a line of its own with what decided it, the fewest nodes that the training state alone rules
out, and the command's flags that would change the answer."""

from __future__ import annotations

import math
from typing import Any

from .cost_model import InfeasiblePlanError

GB = 1e9


def nothing_fits(error: InfeasiblePlanError, ranks: int, per_node: int, memory_gb: float, state_bytes: int,
                 bytes_per_parameter: float, replication: str, precision: str | None = None) -> str:
    """The report of ``error`` (a layout search that found nothing to fit, its ``layouts``) for
    ``ranks`` ranks, ``per_node`` to a node, of ``memory_gb`` each, for a model whose weights,
    gradients and optimizer state take ``state_bytes`` (``bytes_per_parameter`` a parameter)."""
    nodes = math.ceil(ranks / per_node)
    lines = [f"no layout of {ranks} ranks ({nodes} node{'s' if nodes > 1 else ''} of {per_node}) fits in "
             f"{memory_gb:.3g} GB a rank:"]
    best: dict[tuple, dict[str, Any]] = {}
    for row in error.layouts:
        key = (row.get("dp"), row.get("pp"), row.get("schedule"), row.get("regather"))
        need = row.get("peak_memory_bytes")
        known = best.get(key)
        if known is None or (need is not None and need < (known.get("peak_memory_bytes") or math.inf)):
            best[key] = row
    for (dp, pp, schedule, regather), row in best.items():
        gathered = {"micro_batch": ", FSDP2 gathering per micro-batch", "step": ", FSDP2 gathering once per step"}
        label = f"dp={dp} x pp={pp} {schedule}{gathered.get(regather, '')}"
        need, limit = row.get("peak_memory_bytes"), row.get("limit_bytes")
        if need is not None and limit is not None:
            where = "a rank" if limit >= memory_gb * GB * 0.999 else f"a stage (of {limit / GB:.3g} GB)"
            lines.append(f"  {label}: memory, {need / GB:.3g} GB on {where}")
        else:
            lines.append(f"  {label}: {_short(row.get('lost', 'does not run'))}")
    floor = math.ceil(state_bytes / (memory_gb * GB))
    floor_nodes = math.ceil(floor / per_node)
    lines.append(f"the weights, gradients and optimizer state alone take {state_bytes / GB:,.0f} GB "
                 f"({bytes_per_parameter:g} bytes a parameter): at least {floor} ranks of {memory_gb:.3g} GB, "
                 f"{floor_nodes} node{'s' if floor_nodes > 1 else ''} of {per_node}, before any activation")
    fixes = []
    if floor_nodes > nodes:
        fixes.append(f"--ranks {floor_nodes * per_node} --per-node {per_node} ({floor_nodes} nodes) or more")
    else:
        fixes.append(f"--ranks {(nodes + 1) * per_node} --per-node {per_node} (one node more)")
    if replication != "fsdp":
        fixes.append("--replication fsdp (replicas shard their stage's state)")
    if precision == "bf16-mixed" or precision == "32-true":
        fixes.append("--precision bf16-true (8 bytes a parameter with AdamW, not 16)")
    fixes.append("a smaller --batch-size or --sequence-length (fewer activations)")
    lines.append("to fit, give " + "; or ".join(fixes))
    return "\n".join(lines)


def _short(text: str, width: int = 110) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 3] + "..."
