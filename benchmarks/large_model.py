"""A 2 B decoder planned from the meta device without ever being whole in memory; and a 100 M one
built on meta and trained over four stages, each within a quarter of the model's training bytes.

Part 1 builds a decoder of about 2 B parameters (bf16) on meta, then profiles and plans it over 4
stages on ``--device``, one operation's modules real at a time. It prints the planning process's
peak memory (resident set on the CPU, the allocator's peak on a GPU) against the model's bytes,
and the time to plan.

Part 2 builds a decoder of about 100 M parameters in ``configure_model()`` with ``empty_init=True``,
sets ``memory_gb`` to a quarter of its training bytes (parameters, gradients, Adam state, and the
activations of a whole batch), and trains a few steps over 4 stages through the Lightning Trainer.
It prints each stage's measured bytes against the plan's prediction: on the CPU counted by the
runtime (the stage's tensors, and what autograd's hooks saw kept for backward), on a GPU from the
allocator's peak on each device (one stage per GPU; with fewer GPUs than stages, all stages on
one GPU, ``placement=[0, 0, 0, 0]``, against the sum of their predictions).

Part 3 (``--part llama``) is a Hugging Face model as people bring one. It plans a Llama of
Llama-2-70B's shapes (bf16, 69 B parameters, random values never made real whole) from meta through
``la.plan``: 8 stages, batches of 8 x 128 tokens in 8 micro-batches. The 80 equal layers are
profiled once. It prints the planning peak against the model's bytes, the time, the bytes the
stages hold and the plan's balance. It then writes a 1 B Llama as a sharded safetensors directory,
builds it on meta in ``configure_model()``, loads it lazily (``la.load_checkpoint``) and trains a
few steps over 4 stages, reporting each stage's measured peak against its prediction.

Part 4 (``--part nodes``) plans the same Llama-2-70B shapes for training past one node: nodes of
8 GPUs of 80 GB (NVLink within a node, one 200 Gb/s adapter per GPU across), AdamW in bf16-mixed
(fp32 weights, gradients and both moments: 16 bytes a parameter), FSDP2 over each stage's
replicas a decoder layer at a time. For 1, 2, 4, ... nodes (or ``--nodes N``) it runs
``pipeline_parallel_size="auto"``'s search over every layout of replicas x stages, schedule, micro-batch count
and FSDP2 regather, and stops at the fewest nodes where a layout fits. It prints, for each node
count, the candidate whose ranks need the least memory and the layout chosen, then each layout's
best candidate and why it lost, the search's time and the process's peak resident set.
``--node-model 405b`` does the same for Llama-3.1-405B's shapes. The model is profiled on this
machine's CPU from meta; the GPUs are named for the memory and the links, so the step times are
this CPU's, not a GPU's.

    python benchmarks/large_model.py              # parts 1 and 2, on the CPU
    python benchmarks/large_model.py --part llama # part 3
    python benchmarks/large_model.py --part nodes # part 4
    python benchmarks/large_model.py --part nodes --node-model 405b --nodes 4
    python benchmarks/large_model.py --device cuda:0 --part train
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_antichain as la
from lightning_antichain.in_process.budget import state_bytes
from lightning_antichain.planner.planning import plan_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, publish, section  # noqa: E402

START, END = "<!-- large-model:start -->", "<!-- large-model:end -->"
LLAMA_START, LLAMA_END = "<!-- llama:start -->", "<!-- llama:end -->"
NODES_MARKERS = {"70b": ("<!-- llama-nodes:start -->", "<!-- llama-nodes:end -->"),
                 "405b": ("<!-- llama-405b-nodes:start -->", "<!-- llama-405b-nodes:end -->")}
BF16_MIXED_ADAMW = 6.0
"""Optimizer state per bf16 parameter byte in bf16-mixed with AdamW: an fp32 master copy and two
fp32 moments (12 bytes per 2), so that with the parameter and its gradient a parameter costs 16."""
LLAMA_2_70B = dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                   num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096, rms_norm_eps=1e-5,
                   use_cache=False, tie_word_embeddings=False)
LLAMA_3_1_405B = dict(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                      num_attention_heads=128, num_key_value_heads=8, max_position_embeddings=4096, rms_norm_eps=1e-5,
                      use_cache=False, tie_word_embeddings=False)
#: part 4's models, by --node-model
NODE_MODELS = {"70b": ("Llama-2-70B", LLAMA_2_70B), "405b": ("Llama-3.1-405B", LLAMA_3_1_405B)}
LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048, use_cache=False,
                tie_word_embeddings=False)
BIG = {"vocab": 50304, "width": 2560, "heads": 20, "layers": 25, "block": 128}
SMALL = {"vocab": 8192, "width": 768, "heads": 12, "layers": 14, "block": 128}


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, c))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    """A GPT-style decoder: token and position embeddings, pre-norm blocks, an untied head."""

    def __init__(self, vocab: int, width: int, heads: int, layers: int, block: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.head(self.norm(self.blocks(self.tokens(ids) + self.positions(positions))))


def nbytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def plan_big(device: torch.device, stages: int, tokens: int) -> list[str]:
    """Part 1: plan the 2 B decoder from meta; its peak memory against its bytes."""
    with torch.device("meta"):
        model = Decoder(**BIG).to(torch.bfloat16)
    total = nbytes(model)
    optimizer = torch.optim.Adam(model.parameters())
    ids = torch.randint(0, BIG["vocab"], (1, tokens))
    gc.collect()
    before = peak_rss_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    planned = plan_model(model, (ids,), {}, [device] * stages, chunks=4, use_profile_cache=False,
                         optimizers=[optimizer], progress=True, calibrate=False)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()
    print(planned.plan.table())
    where = "allocator peak on " + str(device) if device.type == "cuda" else "peak resident set of the process"
    return [
        f"**Planning a {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B-parameter decoder from meta** "
        f"({BIG['layers']} blocks of width {BIG['width']}, vocabulary {BIG['vocab']}, bf16: {total / 1e9:.2f} GB of "
        f"parameters; one micro-batch of {tokens} tokens, {stages} stages, Adam):",
        "",
        "| model bytes | planning peak | peak / model | peak before planning | time to plan |",
        "|---|---|---|---|---|",
        f"| {total / 1e9:.2f} GB | {peak / 1e9:.2f} GB ({where}) | {peak / total:.2f} | {before / 1e9:.2f} GB | "
        f"{seconds:.0f} s |",
        "",
    ]


class Small(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model: Decoder | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = Decoder(**SMALL)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self(ids[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class Measured(L.Callback):
    """Each stage's bytes after the last optimizer step: counted, and the allocator's peaks."""

    def __init__(self) -> None:
        self.counted: list[int] = []
        self.allocated: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pipeline = trainer.strategy.pipeline
        self.counted = [state_bytes(stage, trainer.optimizers) + kept
                        for stage, kept in zip(pipeline.stages, pipeline.last_activation_bytes)]
        self.allocated = [torch.cuda.max_memory_allocated(stage.device) if stage.device.type == "cuda" else 0
                          for stage in pipeline.stages]


def train_small(device: torch.device, stages: int, batch: int, chunks: int, steps: int) -> list[str]:
    """Part 2: train the 100 M decoder over ``stages`` under a quarter of its training bytes."""
    with torch.device("meta"):
        reference = Decoder(**SMALL)
    params = nbytes(reference)
    tokens = SMALL["block"]
    activations = _activation_bytes(batch, tokens - 1)
    training = 4 * params + activations  # parameters, gradients, Adam's two moments; a batch's activations
    # beside the first stage, on the root device: the batch's logits joined, their gradient and the loss's workspace
    loss_side = 4 * 4 * batch * (tokens - 1) * SMALL["vocab"]
    budget = training / 4 + loss_side
    ids = torch.randint(0, SMALL["vocab"], (batch * steps, tokens))
    data = DataLoader(TensorDataset(ids), batch_size=batch)
    measured = Measured()
    gpu = device.type == "cuda"
    shared = gpu and torch.cuda.device_count() - (device.index or 0) < stages  # all stages on one GPU
    gpus = [device.index or 0] if shared else [(device.index or 0) + k for k in range(stages)]
    strategy = la.AntichainPipelineStrategy(chunks=chunks, empty_init=True, profile_cache=False, calibrate=False,
                                            memory_gb=budget * (stages if shared else 1) / 1e9,
                                            placement=[0] * stages if shared else None)
    trainer = L.Trainer(accelerator="gpu" if gpu else "cpu", devices=gpus if gpu else stages, strategy=strategy,
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_model_summary=False,
                        callbacks=[measured])
    started = time.perf_counter()
    trainer.fit(Small(), data)
    seconds = time.perf_counter() - started
    plan = trainer.strategy.plan
    print(plan.table())
    observed = measured.allocated if gpu else measured.counted
    how = "allocator peak" if gpu else "counted by the runtime"
    lines = [
        f"**Training a {sum(p.numel() for p in reference.parameters()) / 1e6:.0f} M-parameter decoder built in "
        f"configure_model() on meta** ({SMALL['layers']} blocks of width {SMALL['width']}, float32, Adam; batches of "
        f"{batch} x {tokens - 1} tokens in {plan.chunks} micro-batches; {steps} steps in {seconds:.0f} s). "
        f"Training bytes {training / 1e9:.2f} GB ({params / 1e9:.2f} GB of parameters); `memory_gb` = a quarter and "
        f"what the batch's loss holds beside the first stage ({loss_side / 1e9:.3f} GB: the logits joined, their "
        f"gradient, the loss's workspace), {budget / 1e9:.3f} GB per stage:",
        "",
        f"| stage | device | ops | predicted | measured ({how}) | measured / predicted |",
        "|---|---|---|---|---|---|",
    ]
    if shared:  # one allocator for all the stages: their sum against its peak
        predicted = sum(stage.memory_bytes for stage in plan.stages)
        lines.append(f"| all | {device} | {sum(len(s.nodes) for s in plan.stages)} | {predicted / 1e9:.3f} GB | "
                     f"{observed[0] / 1e9:.3f} GB | {observed[0] / predicted:.3f} |")
        return [*lines, ""]
    for stage, seen in zip(plan.stages, observed):
        # the runtime counts its stages; the allocator also sees the batch's loss beside the first
        predicted = stage.memory_bytes - (0 if gpu else stage.joined_output_bytes + stage.loss_workspace_bytes)
        lines.append(f"| {stage.index} | {stage.device} | {len(stage.nodes)} | {predicted / 1e9:.3f} GB | "
                     f"{seen / 1e9:.3f} GB | {seen / predicted:.3f} |")
    if not gpu:
        beside = plan.stages[0].joined_output_bytes + plan.stages[0].loss_workspace_bytes
        lines += ["", f"Predicted and counted: the stages alone; stage 0's device also holds {beside / 1e9:.3f} GB "
                      "that the plan charges for the batch's loss (the logits joined, their gradient, the loss's "
                      "workspace), which the runtime does not count."]
    return [*lines, ""]


def llama(config: dict, dtype: torch.dtype) -> nn.Module:
    """A Hugging Face Llama of ``config``'s shapes, its parameters on meta (its buffers real)."""
    import transformers

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with la.init_empty_weights():
            return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    finally:
        torch.set_default_dtype(default)


def plan_llama(device: torch.device, stages: int, batch: int, tokens: int, chunks: int) -> list[str]:
    """Part 3a: plan Llama-2-70B's shapes from meta through ``la.plan``."""
    model = llama(LLAMA_2_70B, torch.bfloat16)
    total = nbytes(model)
    ids = torch.randint(0, LLAMA_2_70B["vocab_size"], (batch, tokens))
    gc.collect()
    before = peak_rss_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    plan = la.plan(model, ids, [device] * stages, chunks=chunks, use_profile_cache=False, calibrate=False,
                   optimizer_multiplier=2.0)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()
    print(plan.table())
    held = sum(stage.param_bytes for stage in plan.stages)
    where = "allocator peak on " + str(device) if device.type == "cuda" else "peak resident set of the process"
    repeated = sum(len(blocks) for blocks in plan.repeated_blocks.values())
    return [
        f"**Planning a Hugging Face Llama of Llama-2-70B's shapes from meta** "
        f"(`LlamaForCausalLM`, {sum(p.numel() for p in model.parameters()) / 1e9:.1f} B parameters, bf16: "
        f"{total / 1e9:.1f} GB; batches of {batch} x {tokens} tokens in {plan.chunks} micro-batches, {stages} "
        f"stages, Adam's state counted; {repeated} of {LLAMA_2_70B['num_hidden_layers']} layers profiled once as "
        f"repeats of the first):",
        "",
        "| model bytes | planning peak | peak / model | peak before planning | time to plan | stages hold | "
        "bottleneck / bound |",
        "|---|---|---|---|---|---|---|",
        f"| {total / 1e9:.1f} GB | {peak / 1e9:.2f} GB ({where}) | {peak / total:.3f} | {before / 1e9:.2f} GB | "
        f"{seconds:.0f} s | {held / total:.3f} of the parameter bytes | x{plan.bound_ratio:.3f} |",
        "",
        "Stages: " + "; ".join(f"{s.index}: {s.modules[0]} .. {s.modules[-1]}" for s in plan.stages if s.modules),
        "",
    ]


def plan_nodes(key: str, gpus: int, gpu_gb: float, batch: int, tokens: int, nodes: int | None,
               most_nodes: int = 16) -> list[str]:
    """Part 4: the fewest nodes of ``gpus`` GPUs of ``gpu_gb`` that train ``NODE_MODELS[key]``'s
    shapes (or the plan for ``nodes`` nodes), and why every other layout lost."""
    from lightning_antichain.planner.cost_model import InfeasiblePlanError
    from lightning_antichain.planner.layout_cost import Links
    from lightning_antichain.planner.layout_search import layout_search, plan_layouts
    from lightning_antichain.plans.options import PipelineOptions

    name, config = NODE_MODELS[key]
    model = llama(config, torch.bfloat16)
    count = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, config["vocab_size"], (batch, tokens))
    links = Links(gpus, within_gbps=150.0, across_gbps=25.0)

    def devices_of(layout, schedule) -> list[torch.device]:
        return [torch.device("cuda", layout.rank(0, schedule.rank_of(s, layout.pp)) % gpus)
                for s in range(schedule.num_stages(layout.pp))]

    state = 16 * count
    lines = [
        f"**Planning {name}'s shapes past one node** (`LlamaForCausalLM` from meta, {count / 1e9:.1f} B "
        f"parameters; AdamW in bf16-mixed: {state / 1e12:.2f} TB of weights, gradients and moments; nodes of "
        f"{gpus} GPUs of {gpu_gb:.0f} GB, 150 GB/s within a node, 25 GB/s across; FSDP2 over each stage's replicas, "
        f"a decoder layer at a time; batches of {batch} x {tokens} tokens; every layout, schedule, micro-batch count "
        "and FSDP2 regather weighed, each cut by the antichain DP):",
        "",
        "| nodes | GPUs | fits | least memory per rank of any candidate | its layout | chosen | predicted peak per "
        "rank | candidates weighed | time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    started = time.perf_counter()
    worlds = [nodes] if nodes else [2 ** i for i in range(most_nodes.bit_length()) if 2 ** i <= most_nodes]
    plan, rows, world = None, [], 0
    with tempfile.TemporaryDirectory() as cache:
        options = PipelineOptions(memory_gb=gpu_gb, optimizer_multiplier=BF16_MIXED_ADAMW, calibrate=False,
                                  profile_cache=Path(cache), method="antichain", progress=False)
        for count_nodes in worlds:
            world = count_nodes * gpus
            began = time.perf_counter()
            try:
                plan = plan_layouts(model, (ids,), {}, world, devices_of, layout_search("auto", "auto", None), links,
                                    options, replication="fsdp", profile_device=torch.device("cpu")).plan
                rows, chosen = plan.layouts, plan.layout
            except InfeasiblePlanError as exc:
                rows, chosen, plan = exc.layouts, None, None
            weighed = [r for r in rows if r.get("peak_memory_bytes")]
            least = min(weighed, key=lambda r: r["peak_memory_bytes"]) if weighed else None
            smallest = "- | -" if least is None else f"{least['peak_memory_bytes'] / 1e9:.1f} GB | {_layout(least)}"
            picked = "- | -" if plan is None or chosen is None else (
                f"{_layout(chosen)}, {plan.chunks} micro-batches | {_chosen_peak(plan) / 1e9:.1f} GB")
            lines.append(f"| {count_nodes} | {world} | {'yes' if plan else 'no'} | {smallest} | {picked} | {len(rows)} "
                         f"| {time.perf_counter() - began:.0f} s |")
            print(lines[-1], flush=True)
            if plan is not None:
                break
    lines += ["", f"Searched in {time.perf_counter() - started:.0f} s; the peak resident set of the process "
              f"that planned it: {peak_rss_bytes() / 1e9:.2f} GB. Per rank the training state alone is "
              f"{state / world / 1e9:.0f} GB when {world} GPUs share it evenly (pure FSDP2), against {gpu_gb:.0f} GB.",
              "", f"**Each layout of {world} ranks, its best candidate** (the fastest that fits, else the one needing "
              "the least memory), and why it lost:", "",
              "| layout | schedule | micro-batches | FSDP2 gathers | predicted step s | peak per rank GB | verdict |",
              "|---|---|---|---|---|---|---|"]
    for row in _best_per_layout(rows):
        step = row.get("predicted_step_s")
        peak = row.get("peak_memory_bytes")
        lines.append(f"| dp={row['dp']} x pp={row['pp']} | {_schedule(row)} | {row.get('chunks') or '-'} "
                     f"| {row.get('regather', '-')} | {'-' if step is None else f'{step:.1f}'} "
                     f"| {'-' if peak is None else f'{peak / 1e9:.1f}'} | {row.get('lost', 'chosen')} |")
    if plan is not None:
        lines += ["", "The plan of the layout chosen:", "", "```", plan.table(), "```"]
    return lines


def _layout(row: dict) -> str:
    return f"dp={row['dp']} x pp={row['pp']} {_schedule(row)}"


def _schedule(row: dict) -> str:
    virtual = row.get("virtual_stages") or 1
    return row["schedule"] + (f" ({virtual} stages each)" if virtual > 1 else "")


def _best_per_layout(rows: list[dict]) -> list[dict]:
    """Per dp x pp: the fitting candidate with the shortest predicted step, else the one needing the
    least memory, else the first (which says why none was weighed)."""
    best: dict[tuple[int, int], dict] = {}
    for row in rows:
        key = (row["dp"], row["pp"])
        rank = ((0, row["predicted_step_s"]) if "predicted_step_s" in row and "needs" not in row.get("lost", "")
                else (1, row["peak_memory_bytes"]) if row.get("peak_memory_bytes") else (2, 0))
        if key not in best or rank < best[key][0]:
            best[key] = (rank, row)
    return [row for _, row in sorted(best.values(), key=lambda item: (-item[1]["pp"], item[1]["dp"]))]


def _chosen_peak(plan) -> float:
    (row,) = [r for r in plan.layouts if "lost" not in r]
    return row["peak_memory_bytes"]


class LlamaFineTune(L.LightningModule):
    def __init__(self, checkpoint: Path) -> None:
        super().__init__()
        self.checkpoint, self.net = checkpoint, None

    def configure_model(self) -> None:
        if self.net is None:
            import transformers

            self.net = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_1B))
            la.load_checkpoint(self.net, self.checkpoint)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.net(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def train_llama(device: torch.device, stages: int, batch: int, tokens: int, chunks: int, steps: int,
                directory: Path) -> list[str]:
    """Part 3b: a 1 B Llama written as sharded safetensors, built on meta and loaded lazily, trained."""
    import transformers

    if not (directory / "model.safetensors.index.json").exists():
        with torch.random.fork_rng():
            torch.manual_seed(0)
            transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_1B)).save_pretrained(
                directory, max_shard_size="500MB")
    ids = torch.randint(0, LLAMA_1B["vocab_size"], (batch * steps, tokens))
    measured = Measured()
    gpu = device.type == "cuda"
    shared = gpu and torch.cuda.device_count() - (device.index or 0) < stages
    gpus = [device.index or 0] if shared else [(device.index or 0) + k for k in range(stages)]
    strategy = la.AntichainPipelineStrategy(chunks=chunks, empty_init=True, module="net", profile_cache=False,
                                            calibrate=False, placement=[0] * stages if shared else None,
                                            memory_gb=1e3)  # a limit turns on the run-time count
    trainer = L.Trainer(accelerator="gpu" if gpu else "cpu", devices=gpus if gpu else stages, strategy=strategy,
                        precision="bf16-true", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[measured])
    started = time.perf_counter()
    trainer.fit(LlamaFineTune(directory), DataLoader(TensorDataset(ids), batch_size=batch))
    seconds = time.perf_counter() - started
    plan = trainer.strategy.plan
    print(plan.table())
    observed = measured.allocated if gpu else measured.counted
    how = "allocator peak" if gpu else "counted by the runtime"
    params = sum(s.param_bytes for s in plan.stages)
    lines = [
        f"**Training a 1 B Hugging Face Llama built on meta and loaded lazily from a sharded safetensors "
        f"directory** ({params / 1e9:.2f} GB of bf16 parameters in {len(list(directory.glob('*.safetensors')))} "
        f"shards; bf16-true, SGD; batches of {batch} x {tokens} tokens in {plan.chunks} micro-batches; {steps} "
        f"steps in {seconds:.0f} s):",
        "",
        f"| stage | device | modules | predicted | measured ({how}) | measured / predicted |",
        "|---|---|---|---|---|---|",
    ]
    if shared:
        predicted = sum(stage.memory_bytes for stage in plan.stages)
        lines.append(f"| all | {device} | | {predicted / 1e9:.3f} GB | {observed[0] / 1e9:.3f} GB | "
                     f"{observed[0] / predicted:.3f} |")
        return [*lines, ""]
    for stage, seen in zip(plan.stages, observed):
        span = f"{stage.modules[0]} .. {stage.modules[-1]}" if stage.modules else ""
        lines.append(f"| {stage.index} | {stage.device} | {span} | {stage.memory_bytes / 1e9:.3f} GB | "
                     f"{seen / 1e9:.3f} GB | {seen / stage.memory_bytes:.3f} |")
    return [*lines, ""]


def _activation_bytes(batch: int, tokens: int) -> int:
    """A rough count of what a float32 batch keeps for backward: per block about 16 width-sized
    and 2 head-by-token-squared values per token, plus the logits twice."""
    width, heads, layers, vocab = SMALL["width"], SMALL["heads"], SMALL["layers"], SMALL["vocab"]
    per_token = layers * (16 * width + 2 * heads * tokens) + 2 * vocab
    return 4 * batch * tokens * per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--part", choices=("plan", "train", "both", "llama", "nodes"), default="both")
    parser.add_argument("--checkpoint-dir", default="checkpoints/llama-1b",
                        help="where part 3 writes (or finds) the 1 B Llama's shards")
    parser.add_argument("--llama-steps", type=int, default=2)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64, help="tokens of the micro-batch part 1 profiles")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmark-runs.md as it is")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-gb", type=float, default=80.0)
    parser.add_argument("--node-batch", type=int, default=32, help="sequences per step, part 4")
    parser.add_argument("--node-tokens", type=int, default=128, help="tokens per sequence, part 4")
    parser.add_argument("--node-model", choices=sorted(NODE_MODELS), default="70b", help="part 4's shapes")
    parser.add_argument("--nodes", type=int, help="part 4 plans this many nodes (default: the fewest that fit)")
    args = parser.parse_args()
    device = torch.device(args.device)
    lines = [f"Machine: {machine(torch.get_num_threads())}" + (f", {torch.cuda.get_device_name(device)}"
                                                               if device.type == "cuda" else ""), ""]
    if args.part == "nodes":
        lines += plan_nodes(args.node_model, args.gpus_per_node, args.gpu_gb, args.node_batch, args.node_tokens,
                            args.nodes)
        start, end = NODES_MARKERS[args.node_model]
        publish(section(start, end, lines), start, end, "## A model bigger than one node", not args.no_write)
        return
    if args.part == "llama":
        lines += plan_llama(device, 8, 8, 128, 8)
        lines += train_llama(device, 4, 8, 128, 4, args.llama_steps, Path(args.checkpoint_dir))
        publish(section(LLAMA_START, LLAMA_END, lines), LLAMA_START, LLAMA_END, "## A model bigger than one device",
                not args.no_write)
        return
    if args.part in ("plan", "both"):
        lines += plan_big(device, args.stages, args.tokens)
    if args.part in ("train", "both"):
        lines += train_small(device, args.stages, args.batch, args.chunks, args.steps)
    publish(section(START, END, lines), START, END, "## A model bigger than one device", not args.no_write)


if __name__ == "__main__":
    main()
