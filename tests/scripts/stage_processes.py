"""Fit a float64 model with skips with one process per stage (or plain Lightning); each rank writes JSON.

python stage_processes.py --out DIR --devices 2 --schedule 1f1b   # 2 processes, Lightning's launcher
python stage_processes.py --out DIR --plain                        # plain Lightning, one device
torchrun --nnodes 2 --node-rank N --nproc-per-node 2 --master-addr 127.0.0.1 --master-port P \
    stage_processes.py --out DIR --devices 2 --num-nodes 2 --stages 2   # node N of two: 2 replicas x 2 stages
python stage_processes.py --out DIR --max-epochs 1 --save a.ckpt   # then --max-epochs 2 --resume a.ckpt
FAIL_HOW=forward FAIL_AT=3 FAIL_BLOCK=4 python stage_processes.py ... --every 2   # a fault at step 3
FAIL_HOW=stalled STALL_S=20 FAIL_AT=3 python stage_processes.py ... --timeout 4   # a stage stuck for 20 s

Each rank writes DIR/rank{r}.json: its process id, the step losses Lightning got from training_step,
the logged train_loss, the validation loss, a metric logged from the steps, the parameters that
training changed in this process, and every parameter's final value.
"""

import argparse
import json
import os
import time
from pathlib import Path

import lightning as L
import torch
import torchmetrics
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_antichain as la
from lightning_antichain.cpu_allocator import freed_memory_kept


class Fault(torch.autograd.Function):
    """Raises in forward or backward, or ends the process, on the step named by the environment."""

    @staticmethod
    def forward(ctx, x):
        if _failing("forward"):
            raise RuntimeError("injected failure in a stage's forward")
        if _failing("killed"):
            os._exit(9)
        if _failing("stalled"):
            time.sleep(float(os.environ.get("STALL_S", 30)))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if _failing("backward"):
            raise RuntimeError("injected failure in a stage's backward")
        return grad


STEP = [0]


def _failing(how: str) -> bool:
    return os.environ.get("FAIL_HOW") == how and STEP[0] == int(os.environ.get("FAIL_AT", -1))


class FaultLayer(nn.Module):  # kept whole by capture (a leaf), so the stage holding it runs it
    def forward(self, x):
        return Fault.apply(x)


class Skips(L.LightningModule):
    """An MLP whose first activation is read again by its last layer (a skip over every middle cut)."""

    def __init__(self, width: int = 32, depth: int = 6, adam: bool = False, batchnorm: bool = False):
        super().__init__()
        self.adam = adam
        self.inp = nn.Linear(16, width)
        self.norm = nn.BatchNorm1d(width) if batchnorm else nn.Identity()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 4)
        self.fault = FaultLayer()
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)
        self.mesh_seen = None

    def configure_model(self):
        mesh = self.device_mesh  # with schedule=: the ranks' ("dp", "pp") mesh
        self.mesh_seen = None if mesh is None else {"dims": list(mesh.mesh_dim_names), "ranks": mesh.mesh.tolist()}

    def forward(self, x):
        first = torch.tanh(self.norm(self.inp(x)))
        h = first
        for i, block in enumerate(self.blocks):
            h = torch.tanh(block(h)) + h
            if i == int(os.environ.get("FAIL_BLOCK", 2)):  # which stage holds the fault follows the plan
                h = self.fault(h)
        return self.out(h + first)

    def on_train_batch_start(self, batch, batch_idx):
        STEP[0] = self.global_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        if _failing("training_step"):
            raise RuntimeError("injected failure in training_step")
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss)
        self.train_acc(logits.argmax(-1), y)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        return {"probabilities": self(batch[0]).softmax(-1)}

    def configure_optimizers(self):
        if self.adam:
            return torch.optim.AdamW(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


VOCAB = 40


class TiedGPT(L.LightningModule):
    """GPT-2 (captured by torch.export) whose input embedding is its output layer's weight: with
    two stages, the first and the last rank each hold a copy."""

    def __init__(self, adam: bool = False, meta: bool = False):
        super().__init__()
        self.net = self.build()
        assert self.net.lm_head.weight is self.net.transformer.wte.weight
        self.adam = adam
        #: with --meta: the net is built again in configure_model, on the meta device, and these
        #: weights go in as a pretrained checkpoint's would, each rank reading its stages' only
        self.initial = {k: v.double() for k, v in self.net.state_dict().items()} if meta else None
        if meta:
            self.net = None

    @staticmethod
    def build():
        import transformers

        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                         use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config)

    def configure_model(self):
        if self.net is None:
            self.net = self.build()
            la.load_state_dict(self.net, self.initial)
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=VOCAB)

    def forward(self, tokens):
        return self.net(input_ids=tokens).logits

    def training_step(self, batch, batch_idx):
        tokens, target = batch
        logits = self(tokens)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
        self.log("train_loss", loss)
        self.train_acc(logits.argmax(-1).reshape(-1), target.reshape(-1))
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        tokens, target = batch
        self.log("val_loss", nn.functional.cross_entropy(self(tokens).reshape(-1, VOCAB), target.reshape(-1)))

    def configure_optimizers(self):
        if self.adam:
            return torch.optim.AdamW(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def tokens(samples: int = 96, batch_size: int = 16) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, VOCAB, (samples, 9), generator=gen)
    return DataLoader(TensorDataset(sequences[:, :-1], sequences[:, 1:]), batch_size=batch_size)


def data(samples: int = 96, batch_size: int = 16) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=gen, dtype=torch.float64)
    y = (x[:, :4] + 0.3 * torch.randn(samples, 4, generator=gen, dtype=torch.float64)).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Record(L.Callback):
    def __init__(self, out: Path):
        self.out, self.losses, self.logged, self.tied = out, [], [], None

    def on_fit_start(self, trainer, module):
        self.initial = {n: p.detach().clone() if p.is_meta else p.detach().cpu().clone()
                        for n, p in module.named_parameters()}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())
        self.logged.append(trainer.callback_metrics["train_loss"].item())
        pipeline = getattr(trainer.strategy, "pipeline", None)  # the in-process runtime's, with a leaf per device
        self.tied = len(pipeline.tied) if isinstance(pipeline, la.Pipeline) else None

    def on_fit_end(self, trainer, module):
        metrics = trainer.callback_metrics
        rank = trainer.global_rank
        shards = {n: p for n, p in module.named_parameters() if isinstance(p, DTensor)}  # FSDP2's, over replicas
        params = {n: (p.full_tensor() if n in shards else p).detach() for n, p in module.named_parameters()}
        params = {n: p if p.is_meta else p.cpu() for n, p in params.items()}  # on meta: another rank's stage
        optimizer = trainer.optimizers[0]
        moments = [v for state in optimizer.state.values() for k, v in state.items() if k != "step"]
        (self.out / f"rank{rank}.json").write_text(json.dumps({
            "pid": os.getpid(), "world_size": trainer.world_size, "node": trainer.node_rank, "losses": self.losses,
            "logged": self.logged,
            "train_acc": metrics["train_acc"].item(), "val_loss": metrics["val_loss"].item(),
            "trained": [n for n, p in params.items()
                        if not p.is_meta and (self.initial[n].is_meta or not torch.equal(p, self.initial[n]))],
            "parameters": {n: p.flatten().tolist() for n, p in params.items()
                           if not p.is_meta},  # a model built on meta is real only where this rank's stages are
            "bytes": {n: [nbytes(p.to_local()), nbytes(p)] for n, p in shards.items()},  # held, whole
            "optimizer_bytes": [sum(nbytes(v.to_local() if isinstance(v, DTensor) else v) for v in moments),
                                sum(nbytes(v) for v in moments)],
            "stage_ops": [len(stage.nodes) for stage in getattr(trainer.strategy, "plan", None).stages]
            if getattr(trainer.strategy, "plan", None) else None,
            "tied_across_devices": self.tied,
            "plan": trainer.strategy.plan.to_dict() if getattr(trainer.strategy, "plan", None) else None,
            "mesh": getattr(module, "mesh_seen", None),
            "compiled_graphs": counters["stats"]["unique_graphs"],  # by torch.compile, with --compile
            "memory_kept": freed_memory_kept(),  # malloc keeps freed memory, as CPU stages have it do
        }))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1, help="with torchrun --nnodes: its node count")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--virtual-stages", type=int, default=None)
    parser.add_argument("--chunks", type=lambda v: v if v == "auto" else int(v), default=4)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--save", default=None, help="write a checkpoint here at the end")
    parser.add_argument("--resume", default=None, help="resume from this checkpoint")
    parser.add_argument("--balance", type=lambda v: [int(n) for n in v.split(",")], default=None,
                        help="operations per stage, instead of planning")
    parser.add_argument("--deferred-bn", action="store_true", help="deferred_batch_norm=True")
    parser.add_argument("--one-file", action="store_true", help="save_distributed_checkpoint=False: one gathered file")
    parser.add_argument("--adam", action="store_true", help="AdamW instead of SGD with momentum")
    parser.add_argument("--model", choices=["skips", "batchnorm", "gpt2"], default="skips")
    parser.add_argument("--meta", action="store_true", help="GPT-2 built on meta in configure_model, then loaded")
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    parser.add_argument("--recompute", default="never")
    parser.add_argument("--predict", action="store_true", help="after fitting, write predictions{rank}.json")
    parser.add_argument("--samples", type=int, default=96, help="training samples (16 per batch)")
    parser.add_argument("--clip", type=float, default=None, help="gradient_clip_val")
    parser.add_argument("--every", type=int, default=None, help="save a checkpoint in --out every this many steps")
    parser.add_argument("--stages", type=lambda v: v if v == "auto" else int(v), default=None,
                        help="processes per pipeline (replicas: the rest), or auto")
    parser.add_argument("--replication", default="ddp", help="how a stage's replicas keep in step")
    parser.add_argument("--layout-trials", type=int, default=None, help="layout_trials")
    parser.add_argument("--sanity-steps", type=int, default=0, help="num_sanity_val_steps")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per batch of each replica")
    parser.add_argument("--compile", action="store_true", help="compile_stages with AOTAutograd's eager backend")
    parser.add_argument("--timeout", type=float, default=None, help="the strategy's timeout, in seconds")
    args = parser.parse_args()
    torch.manual_seed(0)
    schedule = None if args.schedule == "none" else args.schedule  # none: the in-process runtime
    strategy = "auto" if args.plain else la.AntichainPipelineStrategy(
        schedule=schedule, virtual_stages=args.virtual_stages, chunks=args.chunks, profile_cache=False,
        leaf_modules=["fault"], recompute=args.recompute, empty_init=args.meta,
        save_distributed_checkpoint=False if args.one_file else None, balance=args.balance,
        deferred_batch_norm=args.deferred_bn, pipeline_parallel_size=args.stages, replication=args.replication,
        layout_trials=args.layout_trials, timeout=args.timeout,
        compile_stages={"backend": "aot_eager"} if args.compile else False)
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, strategy=strategy,
        precision="64-true", max_epochs=args.max_epochs, accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip,
        limit_val_batches=2, num_sanity_val_steps=args.sanity_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=args.every is not None, callbacks=[Record(Path(args.out)), *(
            [L.pytorch.callbacks.ModelCheckpoint(dirpath=args.out, every_n_train_steps=args.every, save_top_k=-1)]
            if args.every else [])],
    )
    module, loader = (TiedGPT(adam=args.adam, meta=args.meta), tokens) if args.model == "gpt2" else (
        Skips(adam=args.adam, batchnorm=args.model == "batchnorm"), data)
    trainer.fit(module, loader(args.samples, args.batch_size), loader(32, args.batch_size), ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    if args.predict:
        predictions = trainer.predict(module, loader(32))
        (Path(args.out) / f"predictions{trainer.global_rank}.json").write_text(json.dumps(
            [p["probabilities"].cpu().tolist() for p in predictions]))


if __name__ == "__main__":
    main()
