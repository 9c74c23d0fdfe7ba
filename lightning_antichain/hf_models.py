"""A Hugging Face causal LM built from its config alone, on the meta device, for planning: the
``plan`` command's answer to "what layout, and does it fit?" before any GPU is rented.

The config comes from a model directory (as ``huggingface-cli download`` writes it) or a
``config.json``; no weights are read, and the parameters take no memory. The batch is token ids
with ``labels=``, as a fine-tuning step calls the model (its own loss, joined exactly over
micro-batches), so the plan holds the logits and the loss where they are computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .weights.empty_init import init_empty_weights

PRECISIONS: dict[str, tuple[torch.dtype, float]] = {
    "32-true": (torch.float32, 2.0),
    "bf16-true": (torch.bfloat16, 2.0),
    "bf16-mixed": (torch.bfloat16, 6.0),
}
"""Lightning's precision -> the dtype the model is planned in, and AdamW's state per parameter
byte: two moments in the parameters' dtype, or, for bf16-mixed, float32 weights and moments beside
bf16 compute (12 bytes per 2: a parameter costs 16 bytes with its gradient, as in training)."""


def is_hf_config(path: str) -> bool:
    """Whether ``path`` names a Hugging Face config: a directory holding ``config.json``, or a ``.json`` file."""
    found = Path(path).expanduser()
    return (found.is_dir() and (found / "config.json").is_file()) or (found.suffix == ".json" and found.is_file())


@dataclass(frozen=True)
class CausalLMOnMeta:
    """The model on meta, and a batch of token ids for it; where it was built with fewer layers
    than its config's (``layers=``), the path of its layers and how many the config has."""

    model: nn.Module
    batch: dict[str, torch.Tensor]
    layers_path: str | None = None
    config_layers: int | None = None
    period: int = 1


def layer_kinds(config: Any) -> list[Any]:
    """What sets each layer of a decoder's config apart from the others: its attention
    (``layer_types``: sliding or full) and whether its MLP is a mixture of experts (Qwen-MoE's
    ``mlp_only_layers`` and ``decoder_sparse_step``, DeepSeek's ``first_k_dense_replace``)."""
    count = config.num_hidden_layers
    attention = list(getattr(config, "layer_types", None) or [None] * count)
    experts = any(getattr(config, name, None) for name in ("num_local_experts", "num_experts", "n_routed_experts"))
    dense_first = getattr(config, "first_k_dense_replace", None) or 0
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", None) or 1
    return [(attention[i], bool(experts) and i >= dense_first and i not in dense and (i + 1) % step == 0)
            for i in range(count)]


def causal_lm_on_meta(path: str, batch_size: int, sequence_length: int, precision: str = "bf16-true",
                      seed: int = 0, fewest_layers: bool = False) -> CausalLMOnMeta:
    """The causal LM of the config at ``path`` (:func:`is_hf_config`), its parameters on meta in
    ``precision``'s dtype (:data:`PRECISIONS`, whatever dtype the config names), with
    ``use_cache=False`` as training needs, and a batch of ``batch_size`` sequences of
    ``sequence_length`` random token ids, their ``labels`` the same ids. ``fewest_layers``: built
    with only the layers from which the others follow by repetition
    (:func:`~lightning_antichain.planner.deeper.fewest_layers`), for a cost graph to be extended
    to the config's depth."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError('planning a Hugging Face model needs transformers: pip install "lightning-antichain[hf]"'
                          ) from exc
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    if batch_size < 1 or sequence_length < 1:
        raise ValueError("--batch-size and --sequence-length must be at least 1")
    config = transformers.AutoConfig.from_pretrained(str(Path(path).expanduser()), use_cache=False)
    vocab = getattr(config, "vocab_size", None)
    if not vocab:
        raise ValueError(f"{path}: the config has no vocab_size; the plan command plans causal LMs that take token ids")
    max_length = getattr(config, "max_position_embeddings", None)
    if max_length and sequence_length > max_length:
        raise ValueError(f"--sequence-length {sequence_length} is longer than the model's max_position_embeddings "
                         f"({max_length})")
    dtype = PRECISIONS[precision][0]
    kinds = layer_kinds(config) if getattr(config, "num_hidden_layers", None) else []
    config_layers, period = len(kinds) or None, 1
    if fewest_layers and kinds:
        from .planner.deeper import fewest_layers as fewest
        from .planner.deeper import period_of

        period = period_of(kinds)
        # a period more than the fewest: the blocks an added one copies, and the one before it,
        # are then past a first layer that differs (Mixtral's first MoE layer issues more operations)
        layers = min(len(kinds), fewest(kinds) + period)
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = list(config.layer_types[:layers])
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    # the precision asked for, whatever dtype the config was saved in (every downloaded one names one,
    # and transformers builds in it): the bytes planned are the training run's
    in_dtype = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": dtype}
    try:
        with init_empty_weights():
            model = transformers.AutoModelForCausalLM.from_config(config, **in_dtype)
    except ValueError as exc:
        raise ValueError(f"{path}: not a causal LM transformers can build ({exc})") from None
    finally:
        torch.set_default_dtype(default)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, sequence_length), generator=generator)
    path_of_layers = _layers_path(model, config.num_hidden_layers) if config_layers else None
    return CausalLMOnMeta(model, {"input_ids": ids, "labels": ids}, path_of_layers, config_layers, period)


def _layers_path(model: nn.Module, count: int) -> str | None:
    """The path of the module list that holds the decoder's ``count`` layers (``model.layers``)."""
    return next((name for name, module in model.named_modules()
                 if isinstance(module, nn.ModuleList) and len(module) == count), None)
