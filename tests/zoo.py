"""Real architectures for the capture and pipeline tests: random weights, tiny configs, no downloads.

Each entry builds a model and a batch maker; a batch of ``n`` samples is what ``model(*args, **kwargs)``
takes. The entries cover torchvision, timm, Hugging Face transformers, ``nn.Transformer`` with a causal
mask built in forward, and nanoGPT-style code, which are the models people bring to a pipeline.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ZooEntry:
    build: Callable[[], nn.Module]
    batch: Callable[[int], tuple[tuple, dict]]
    library: str


def _images(size: int, channels: int = 3) -> Callable[[int], tuple[tuple, dict]]:
    return lambda n: ((torch.randn(n, channels, size, size),), {})


def _tokens(vocab: int, length: int, name: str = "input_ids") -> Callable[[int], tuple[tuple, dict]]:
    return lambda n: ((), {name: torch.randint(0, vocab, (n, length))})


# -- nanoGPT-style code: shape checks and tensors built from the sequence length --------------


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, block_size: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, block_size: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, block_size)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's GPT: ``assert t <= block_size`` and ``torch.arange(t)`` in forward, tied embeddings."""

    def __init__(self, vocab: int = 64, width: int = 32, heads: int = 4, layers: int = 4, block_size: int = 32) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(block_size, width)
        self.h = nn.ModuleList(Block(width, heads, block_size) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class TransformerLM(nn.Module):
    """An encoder-decoder around ``nn.Transformer``, with the causal mask built in forward."""

    def __init__(self, vocab: int = 40, width: int = 32, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.transformer = nn.Transformer(
            d_model=width, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64, dropout=dropout,
            batch_first=True,
        )
        self.out = nn.Linear(width, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        length, dtype = tgt.size(1), self.out.weight.dtype
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tgt.device, dtype=dtype)
        return self.out(self.transformer(self.embed(src), self.embed(tgt), tgt_mask=mask))


def _torchvision(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)(**kwargs)

    return build


def _timm(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, **kwargs)

    return build


def _hf(config_name: str, model_name: str, **config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config_name)(**config)
        return getattr(transformers, model_name)(cfg)

    return build


def _seq2seq(vocab: int, src: int, tgt: int) -> Callable[[int], tuple[tuple, dict]]:
    return lambda n: ((), {"input_ids": torch.randint(0, vocab, (n, src)),
                           "decoder_input_ids": torch.randint(0, vocab, (n, tgt))})


ZOO: dict[str, ZooEntry] = {
    "resnet18": ZooEntry(_torchvision("resnet18", num_classes=10), _images(32), "torchvision"),
    "densenet121": ZooEntry(_torchvision("densenet121", num_classes=10), _images(32), "torchvision"),
    "inception_v3": ZooEntry(_torchvision("inception_v3", num_classes=10, aux_logits=False, init_weights=False),
                             _images(75), "torchvision"),
    "mobilenet_v3_small": ZooEntry(_torchvision("mobilenet_v3_small", num_classes=10), _images(32), "torchvision"),
    "vit_b_16_tiny": ZooEntry(
        _torchvision("VisionTransformer", image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                     mlp_dim=64, num_classes=10), _images(32), "torchvision"),
    "timm_vit": ZooEntry(_timm("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10),
                         _images(32), "timm"),
    "timm_swin": ZooEntry(_timm("swin_tiny_patch4_window7_224", img_size=56, depths=(2, 2), num_heads=(2, 4),
                                embed_dim=32, window_size=7, num_classes=10), _images(56), "timm"),
    "timm_convnext": ZooEntry(_timm("convnext_atto", num_classes=10), _images(32), "timm"),
    "timm_efficientnet": ZooEntry(_timm("efficientnet_b0", num_classes=10), _images(32), "timm"),
    "hf_gpt2": ZooEntry(_hf("GPT2Config", "GPT2LMHeadModel", vocab_size=64, n_positions=32, n_embd=32, n_layer=2,
                            n_head=2, use_cache=False), _tokens(64, 12), "transformers"),
    "hf_llama": ZooEntry(_hf("LlamaConfig", "LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64, use_cache=False), _tokens(64, 12), "transformers"),
    "hf_bert": ZooEntry(_hf("BertConfig", "BertForSequenceClassification", vocab_size=64, hidden_size=32,
                            num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                            max_position_embeddings=64, num_labels=3), _tokens(64, 12), "transformers"),
    "hf_t5": ZooEntry(_hf("T5Config", "T5ForConditionalGeneration", vocab_size=64, d_model=32, d_kv=8, d_ff=64,
                          num_layers=2, num_decoder_layers=2, num_heads=4, decoder_start_token_id=0, use_cache=False),
                      _seq2seq(64, 10, 7), "transformers"),
    "nn_transformer": ZooEntry(TransformerLM, lambda n: ((torch.randint(0, 40, (n, 9)), torch.randint(0, 40, (n, 7))),
                                                         {}), "torch.nn"),
    "nanogpt": ZooEntry(NanoGPT, lambda n: ((torch.randint(0, 64, (n, 16)),), {}), "nanoGPT-style"),
}
