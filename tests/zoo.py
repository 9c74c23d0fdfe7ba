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
    """``build`` makes the model, ``batch(n)`` a call's ``(args, kwargs)`` of ``n`` samples.

    ``train``: run in training mode (outputs that only training gives, such as GoogLeNet's
    auxiliary logits) with BatchNorm layers in eval mode, since micro-batches change batch
    statistics. ``slow``: its runs take long enough to go to ``-m slow``.
    """

    build: Callable[[], nn.Module]
    batch: Callable[[int], tuple[tuple, dict]]
    library: str
    train: bool = False
    slow: bool = False

    def model(self) -> nn.Module:
        """The model in float64, in the mode its entry runs in."""
        return modes_set(self.build().double(), self.train)


def modes_set(model: nn.Module, train: bool) -> nn.Module:
    """``model`` in training mode with BatchNorm on running statistics, or in eval mode."""
    model.train(train)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.eval()
    return model


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


# -- models written by hand the way public code writes them -----------------------------------


class LSTMLanguageModel(nn.Module):
    """A word-level LSTM language model, ``batch_first=True``, with tied embeddings."""

    def __init__(self, vocab: int = 50, width: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, layers, batch_first=True)
        self.head = nn.Linear(width, vocab)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(tokens))
        return self.head(hidden)


class UNet(nn.Module):
    """A two-level U-Net: skip connections concatenated across the bottleneck."""

    def __init__(self, channels: int = 3, classes: int = 2, width: int = 8) -> None:
        super().__init__()

        def double_conv(cin: int, cout: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())

        self.down1, self.down2 = double_conv(channels, width), double_conv(width, 2 * width)
        self.bottom = double_conv(2 * width, 4 * width)
        self.up2, self.dec2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, 2), double_conv(4 * width, 2 * width)
        self.up1, self.dec1 = nn.ConvTranspose2d(2 * width, width, 2, 2), double_conv(2 * width, width)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(x)
        d2 = self.down2(F.max_pool2d(d1, 2))
        b = self.bottom(F.max_pool2d(d2, 2))
        u2 = self.dec2(torch.cat([self.up2(b), d2], dim=1))
        u1 = self.dec1(torch.cat([self.up1(u2), d1], dim=1))
        return self.head(u1)


def causal_mask(length: int, device: torch.device) -> torch.Tensor:
    return torch.triu(torch.full((length, length), float("-inf"), device=device), diagonal=1)


def positional_table(length: int, width: int, device: torch.device) -> torch.Tensor:
    position = torch.arange(length, device=device).unsqueeze(1)
    scale = torch.exp(torch.arange(0, width, 2, device=device) * (-math.log(10000.0) / width))
    table = torch.zeros(length, width, device=device)
    table[:, 0::2] = torch.sin(position * scale)
    table[:, 1::2] = torch.cos(position * scale)
    return table


class FirstCallCaches(nn.Module):
    """A positional table built once on the batch's device, and a causal mask rebuilt whenever the
    sequence length changes: caches built on the first call, as public code writes them."""

    def __init__(self, vocab: int = 32, width: int = 16, table: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.attention = nn.MultiheadAttention(width, 2, batch_first=True)
        self.head = nn.Linear(width, vocab)
        self.table = table
        self.pe = None
        self.mask = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.size(1)
        hidden = self.embed(tokens)
        if self.table:
            if self.pe is None:
                self.pe = positional_table(16, hidden.size(-1), tokens.device)
            hidden = hidden + self.pe[:length].to(hidden.dtype)
        if self.mask is None or self.mask.size(0) != length:
            self.mask = causal_mask(length, tokens.device)
        attended, _ = self.attention(hidden, hidden, hidden, attn_mask=self.mask.to(hidden.dtype), need_weights=False)
        return self.head(hidden + attended)


def _torchvision(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)(**kwargs)

    return build


def _torchvision_segmentation(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        return getattr(torchvision.models.segmentation, name)(weights=None, weights_backbone=None, **kwargs)

    return build


def _torchvision_video(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        return getattr(torchvision.models.video, name)(**kwargs)

    return build


def _timm(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, **kwargs)

    return build


class ContrastiveEmbeddings(nn.Module):
    """A CLIP model's per-sample text and image embeddings. Its logits compare every text with every
    image of the batch, which no micro-batch holds: the loss is computed from the embeddings, outside."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        output = self.model(input_ids=input_ids, pixel_values=pixel_values)
        return output.text_embeds, output.image_embeds


def _clip_embeddings(config_name: str, model_name: str, **config: Any) -> Callable[[], nn.Module]:
    return lambda: ContrastiveEmbeddings(_hf(config_name, model_name, **config)())


def _timm_class(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return getattr(timm.models, name)(**kwargs)

    return build


def _hf(config_name: str, model_name: str, **config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config_name)(**config)
        return getattr(transformers, model_name)(cfg)

    return build


def _video(frames: int, size: int) -> Callable[[int], tuple[tuple, dict]]:
    return lambda n: ((torch.randn(n, 3, frames, size, size),), {})


def _audio(samples: int) -> Callable[[int], tuple[tuple, dict]]:
    return lambda n: ((), {"input_values": torch.randn(n, samples)})


def _clip(vocab: int, length: int, size: int) -> Callable[[int], tuple[tuple, dict]]:
    return lambda n: ((), {"input_ids": torch.randint(0, vocab, (n, length)),
                           "pixel_values": torch.randn(n, 3, size, size)})


def _pixels(size: int) -> Callable[[int], tuple[tuple, dict]]:
    return lambda n: ((), {"pixel_values": torch.randn(n, 3, size, size)})


NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
DECODER = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, use_cache=False)


def _seq2seq(vocab: int, src: int, tgt: int) -> Callable[[int], tuple[tuple, dict]]:
    return lambda n: ((), {"input_ids": torch.randint(0, vocab, (n, src)),
                           "decoder_input_ids": torch.randint(0, vocab, (n, tgt))})


ZOO: dict[str, ZooEntry] = {
    "resnet18": ZooEntry(_torchvision("resnet18", num_classes=10), _images(32), "torchvision"),
    "densenet121": ZooEntry(_torchvision("densenet121", num_classes=10), _images(32), "torchvision"),
    "inception_v3": ZooEntry(_torchvision("inception_v3", num_classes=10, aux_logits=False, init_weights=False),
                             _images(75), "torchvision", slow=True),
    "mobilenet_v3_small": ZooEntry(_torchvision("mobilenet_v3_small", num_classes=10), _images(32), "torchvision"),
    "vit_b_16_tiny": ZooEntry(
        _torchvision("VisionTransformer", image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                     mlp_dim=64, num_classes=10), _images(32), "torchvision"),
    "timm_vit": ZooEntry(_timm("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10),
                         _images(32), "timm"),
    "timm_swin": ZooEntry(_timm("swin_tiny_patch4_window7_224", img_size=56, depths=(2, 2), num_heads=(2, 4),
                                embed_dim=32, window_size=7, num_classes=10), _images(56), "timm"),
    "timm_convnext": ZooEntry(_timm("convnext_atto", num_classes=10), _images(32), "timm"),
    "timm_efficientnet": ZooEntry(_timm("efficientnet_b0", num_classes=10), _images(32), "timm", slow=True),
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
    # -- families added for the capture zoo (issue 25) --
    "hf_mistral": ZooEntry(_hf("MistralConfig", "MistralForCausalLM", **DECODER, sliding_window=None),
                           _tokens(64, 12), "transformers"),
    "hf_qwen2": ZooEntry(_hf("Qwen2Config", "Qwen2ForCausalLM", **DECODER), _tokens(64, 12), "transformers"),
    "hf_phi": ZooEntry(_hf("PhiConfig", "PhiForCausalLM", **DECODER, partial_rotary_factor=0.5, resid_pdrop=0.0,
                           embd_pdrop=0.0, attention_dropout=0.0), _tokens(64, 12), "transformers"),
    "hf_mixtral": ZooEntry(_hf("MixtralConfig", "MixtralForCausalLM", **DECODER, num_local_experts=4,
                               num_experts_per_tok=2, router_jitter_noise=0.0,
                               experts_implementation="batched_mm"), _tokens(64, 12), "transformers"),
    "hf_bart": ZooEntry(_hf("BartConfig", "BartForConditionalGeneration", vocab_size=64, d_model=32,
                            encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                            encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
                            attention_dropout=0.0, activation_dropout=0.0, use_cache=False),
                        _seq2seq(64, 10, 7), "transformers"),
    "hf_albert": ZooEntry(_hf("AlbertConfig", "AlbertForSequenceClassification", vocab_size=64, embedding_size=16,
                              hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
                              max_position_embeddings=64, num_labels=3, classifier_dropout_prob=0.0,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), _tokens(64, 12),
                          "transformers"),
    "hf_vit": ZooEntry(_hf("ViTConfig", "ViTForImageClassification", image_size=32, patch_size=8, hidden_size=32,
                           num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, num_labels=5,
                           **NO_DROPOUT), _pixels(32), "transformers"),
    "hf_clip": ZooEntry(_clip_embeddings("CLIPConfig", "CLIPModel",
                            text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, max_position_embeddings=16),
                            vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=2),
                            projection_dim=16), _clip(64, 10, 32), "transformers"),
    "hf_wav2vec2": ZooEntry(_hf("Wav2Vec2Config", "Wav2Vec2ForCTC", vocab_size=32, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                                conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                                mask_time_prob=0.0, layerdrop=0.0, hidden_dropout=0.0, activation_dropout=0.0,
                                attention_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0),
                            _audio(400), "transformers"),
    "timm_maxvit": ZooEntry(_timm("maxvit_rmlp_pico_rw_256", img_size=64, num_classes=10), _images(64), "timm",
                            slow=True),
    "timm_mixer": ZooEntry(_timm_class("MlpMixer", img_size=32, patch_size=8, num_blocks=2, embed_dim=32,
                                       num_classes=10), _images(32), "timm"),
    "timm_regnet": ZooEntry(_timm("regnetx_002", num_classes=10), _images(32), "timm"),
    "deeplabv3": ZooEntry(_torchvision_segmentation("deeplabv3_mobilenet_v3_large", num_classes=4, aux_loss=True),
                          _images(32), "torchvision", slow=True),
    "r3d_18": ZooEntry(_torchvision_video("r3d_18", num_classes=5), _video(4, 16), "torchvision", slow=True),
    "googlenet_train": ZooEntry(_torchvision("googlenet", num_classes=10, aux_logits=True, init_weights=False,
                                             dropout=0.0, dropout_aux=0.0), _images(64), "torchvision", train=True),
    "lstm_lm": ZooEntry(LSTMLanguageModel, lambda n: ((torch.randint(0, 50, (n, 12)),), {}), "torch.nn"),
    "unet": ZooEntry(UNet, _images(32), "torch.nn"),
    "first_call_caches": ZooEntry(FirstCallCaches, lambda n: ((torch.randint(0, 32, (n, 8)),), {}), "torch.nn"),
}
