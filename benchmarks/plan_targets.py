"""Published Hugging Face configs planned for named GPU clusters by ``lightning-antichain plan --gpu``,
on this machine's CPU: how long each plan takes and how much memory, what it chooses and why, its
parameters and training state against arithmetic from the config's shapes, and its predicted
throughput against published runs of the same model, cluster and layout.

    python benchmarks/plan_targets.py                      # every row below, a fresh process each
    python benchmarks/plan_targets.py --only Llama-2-70B   # the rows of one model

Each plan runs as the command does, in a process of its own, timed from its start (imports
included) with its peak resident memory from the kernel (``wait4``). The configs are the
published ``config.json`` files' fields (benchmarks/configs/); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent / "configs"


@dataclass(frozen=True)
class Run:
    """One plan: a model, a cluster of ``nodes`` x ``per_node`` GPUs, a batch, and the flags."""

    model: str
    gpu: str
    nodes: int
    per_node: int
    batch: int
    sequence: int
    flags: tuple[str, ...] = ()
    #: a published run of the same model, cluster and layout: (tokens/s a GPU, its source)
    published: tuple[float, str] | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node

    @property
    def cluster(self) -> str:
        return f"{self.nodes} x {self.per_node} {Path(self.gpu).stem}"


TORCHTITAN = "torchtitan docs/performance.md"
RUNS = [
    Run("Llama-3.1-8B", "H100", 1, 8, 32, 1024),
    Run("Qwen2.5-7B", "H100", 1, 8, 32, 1024),
    Run("Gemma-2-9B", "H100", 1, 8, 32, 1024),
    Run("Mixtral-8x7B", "H100", 1, 8, 32, 1024, note="mixture of experts"),
    Run("Llama-2-70B", "H100", 2, 8, 32, 128, ("--replication", "fsdp"), note="the README's batch"),
    Run("Llama-2-70B", "H100", 2, 8, 256, 4096, ("--replication", "fsdp", "--recompute", "always"),
        note="a million tokens a step"),
    Run("Llama-3.1-405B", "H100", 4, 8, 32, 128, ("--replication", "fsdp", "--precision", "bf16-mixed"),
        note="does not fit: the fewest nodes"),
    Run("Llama-3.1-405B", "H100", 16, 8, 128, 1024, ("--replication", "fsdp", "--recompute", "always")),
    Run("Llama-3.1-8B", str(CONFIGS / "gpus" / "H100-96GB-HBM2e.json"), 1, 8, 16, 8192,
        ("--stages", "1", "--schedule", "1f1b", "--replication", "fsdp", "--recompute", "always"),
        published=(5762, f"{TORCHTITAN}, Table 1: FSDP, local batch 2, selective activation checkpointing, 500 W"),
        note="torchtitan's layout: FSDP over 8"),
    Run("Llama-3-70B", "A100-80GB", 8, 8, 64, 8192,
        ("--stages", "1", "--schedule", "1f1b", "--replication", "fsdp", "--recompute", "always"),
        published=(331, f"{TORCHTITAN}, Llama 3 on 64 A100: FSDP2, local batch 1, full activation checkpointing"),
        note="torchtitan's layout: FSDP over 64"),
]


def parameters_by_arithmetic(config: dict) -> int:
    """A decoder's parameters from its config's shapes: embeddings, each layer's attention, MLP
    (every expert's) and norms, the final norm and the head."""
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    attention = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2
    if config.get("model_type") == "qwen2":
        attention += heads * head_dim + 2 * kv * head_dim  # q, k and v carry biases
    experts = config.get("num_local_experts") or 1
    mlp = 3 * hidden * config["intermediate_size"] * experts
    router = hidden * experts if experts > 1 else 0
    norms = (4 if config.get("model_type") == "gemma2" else 2) * hidden
    head = 0 if config.get("tie_word_embeddings", config.get("model_type") == "gemma2") else vocab * hidden
    return vocab * hidden + layers * (attention + mlp + router + norms) + hidden + head


def plan(run: Run) -> tuple[dict | None, str, float, float]:
    """The plan's JSON (``None`` where it refused), its error, seconds and peak memory in GB."""
    command = [sys.executable, "-m", "lightning_antichain", "plan", str(CONFIGS / run.model), "--gpu", run.gpu,
               "--ranks", str(run.ranks), "--per-node", str(run.per_node), "--batch-size", str(run.batch),
               "--sequence-length", str(run.sequence), "--quiet", "--json"]
    if "--stages" not in run.flags:
        command += ["--stages", "auto"]
    command += list(run.flags)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    peak_gb = usage.ru_maxrss / 1e6  # kilobytes on Linux
    if os.waitstatus_to_exitcode(status) != 0:
        return None, stderr.strip(), seconds, peak_gb
    return json.loads(stdout), "", seconds, peak_gb


def row(run: Run) -> dict:
    config = json.loads((CONFIGS / run.model / "config.json").read_text())
    found, error, seconds, peak_gb = plan(run)
    arithmetic = parameters_by_arithmetic(config)
    result = {"model": run.model, "cluster": run.cluster, "tokens": run.batch * run.sequence, "note": run.note,
              "plan_s": seconds, "plan_peak_gb": peak_gb, "parameters_by_arithmetic": arithmetic}
    if found is None:
        result["refused"] = error.splitlines()
        return result
    layout = found["layout"]
    chosen = next(r for r in found["layouts"] if "lost" not in r)
    dtype_bytes = 4 if "32-true" in run.flags else 2
    planned_bytes = sum(s["param_bytes"] for s in found["stages"])
    multiplier = found["optimizer_multiplier"]
    shards = layout["dp"] if layout.get("replication") == "fsdp" else 1
    per_rank = [0.0] * layout["pp"]
    for index, stage in enumerate(found["stages"]):
        per_rank[_position(index, layout)] += stage["param_bytes"] * (2 + multiplier) / shards
    state_by_arithmetic = arithmetic * dtype_bytes * (2 + multiplier) / (layout["pp"] * shards)
    step = found["predicted_step_s"]
    result.update(
        layout=f"dp={layout['dp']} x pp={layout['pp']} {layout['schedule']}"
               + (f" ({layout['virtual_stages']} stages each)" if layout.get("virtual_stages", 1) > 1 else "")
               + (f", FSDP2 {layout['regather']}" if layout.get("regather") else ""),
        chunks=found["chunks"], predicted_step_s=step, tokens_per_s_gpu=run.batch * run.sequence / step / run.ranks,
        decided_by=chosen.get("decided_by"), terms_s=chosen.get("terms_s"), moved_gb=chosen.get("moved_bytes", 0) / 1e9,
        communication_bound=chosen.get("communication_bound"), peak_rank_gb=chosen["peak_memory_bytes"] / 1e9,
        parameters_planned=planned_bytes // dtype_bytes, state_rank_gb=max(per_rank) / 1e9,
        state_rank_by_arithmetic_gb=state_by_arithmetic / 1e9,
        candidates=[{k: r.get(k) for k in ("dp", "pp", "schedule", "regather", "chunks", "predicted_step_s",
                                          "moved_bytes", "decided_by", "communication_bound", "lost")}
                    for r in found["layouts"]])
    if run.published:
        tokens, source = run.published
        result.update(published_tokens_per_s_gpu=tokens, published_source=source,
                      predicted_over_published=result["tokens_per_s_gpu"] / tokens)
    return result


def _position(stage: int, layout: dict) -> int:
    """The pipeline rank that holds ``stage``: one stage each, round-robin (interleaved 1F1B,
    ZB-H1), or a V (ZBV: out on the ranks and back)."""
    pp = layout["pp"]
    if layout.get("virtual_stages", 1) == 1:
        return stage
    return (stage if stage < pp else 2 * pp - 1 - stage) if layout["schedule"] == "zbv" else stage % pp


def _why(lines: list[str]) -> str:
    """The line of a refusal that says what would fit, else its first."""
    found = next((line for line in lines if "at least" in line), lines[0] if lines else "")
    return found.replace("lightning-antichain: error: ", "")[:160]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="the rows of this model only")
    parser.add_argument("--json", help="write every row, with every candidate, to this file")
    args = parser.parse_args()
    rows = []
    print("| model | cluster | tokens a step | plan s | plan GB | choice | predicted step s | tokens/s a GPU | "
          "decided by | sent GB a rank | peak GB a rank | state GB, fullest rank (mean by arithmetic) | "
          "parameters (arithmetic) |")
    print("|" + " --- |" * 13)
    for run in RUNS:
        if args.only and run.model != args.only:
            continue
        found = row(run)
        rows.append(found)
        if "refused" in found:
            print(f"| {run.model} | {run.cluster} | {found['tokens']:,} | {found['plan_s']:.0f} | "
                  f"{found['plan_peak_gb']:.1f} | refused: {_why(found['refused'])} |  |  |  |  |  |  | "
                  f"{found['parameters_by_arithmetic'] / 1e9:.2f} B |")
            continue
        bound = " (communication-bound)" if found["communication_bound"] else ""
        print(f"| {run.model} | {run.cluster} | {found['tokens']:,} | {found['plan_s']:.0f} | "
              f"{found['plan_peak_gb']:.1f} | {found['layout']}, {found['chunks']} micro-batches | "
              f"{found['predicted_step_s']:.3f} | {found['tokens_per_s_gpu']:,.0f} | {found['decided_by']}{bound} | "
              f"{found['moved_gb']:.3g} | {found['peak_rank_gb']:.1f} | {found['state_rank_gb']:.1f} "
              f"({found['state_rank_by_arithmetic_gb']:.1f}) | {found['parameters_planned'] / 1e9:.3f} B "
              f"({found['parameters_by_arithmetic'] / 1e9:.3f} B) |")
        if "published_tokens_per_s_gpu" in found:
            print(f"|   | published: {found['published_tokens_per_s_gpu']:,} tokens/s a GPU "
                  f"({found['published_source']}); predicted / published = "
                  f"{found['predicted_over_published']:.2f} |" + "  |" * 11)
        sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"\nplanned on {os.cpu_count()} CPU cores of {os.uname().nodename}; "
          f"every plan under 60 s: {all(r['plan_s'] < 60 for r in rows)}, under 4 GB: "
          f"{all(r['plan_peak_gb'] < 4 for r in rows)}")


if __name__ == "__main__":
    main()
