"""The benchmarks' models: random weights, a batch of 32 and its targets, and each one's loss."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """A pre-norm decoder block: causal self-attention and an MLP, shapes from constants only (no
    sizes cross the cuts, which torch's stages could not send)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(h)).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.out(attended.transpose(1, 2).flatten(2))
        return h + self.mlp(self.norm2(h))


class Decoder(nn.Module):
    """A GPT-style decoder returning logits."""

    def __init__(self, layers: int = 8, width: int = 128, heads: int = 4, vocab: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


MODELS = ("gpt", "resnet50", "mlp", "mobilenetv3", "decoder8k")
"""The benchmarks' models: the two the cost model was tuned on, and three it was not (a wide MLP,
MobileNetV3, and a decoder whose 8k-vocabulary embedding and head outweigh its blocks)."""


def build(name: str, device: torch.device) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Model ``name`` (one of ``MODELS``) with random weights, a batch of 32 and its targets."""
    import torchvision

    torch.manual_seed(0)
    if name in ("gpt", "decoder8k"):
        vocab = 512 if name == "gpt" else 8192
        model = Decoder() if name == "gpt" else Decoder(layers=4, vocab=vocab)
        x, y = torch.randint(0, vocab, (32, 64)), torch.randint(0, vocab, (32, 64))
    elif name == "mlp":
        width = 1024
        model = nn.Sequential(*(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                for _ in range(3)), nn.Linear(width, 10))
        x, y = torch.randn(32, width), torch.randint(0, 10, (32,))
    elif name in ("resnet50", "mobilenetv3"):
        model = (torchvision.models.resnet50 if name == "resnet50" else torchvision.models.mobilenet_v3_small)(
            num_classes=10)
        x, y = torch.randn(32, 3, 64, 64), torch.randint(0, 10, (32,))
    else:
        raise SystemExit(f"unknown model {name!r}: choose from {', '.join(MODELS)}")
    return model.to(device), x.to(device), y.to(device)


def loss_of(name: str):
    if name in ("gpt", "decoder8k"):
        return lambda logits, target: nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
    return nn.functional.cross_entropy
