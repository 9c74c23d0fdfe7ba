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
    """The model on meta, and a batch of token ids for it."""

    model: nn.Module
    batch: dict[str, torch.Tensor]


def causal_lm_on_meta(path: str, batch_size: int, sequence_length: int, precision: str = "bf16-true",
                      seed: int = 0) -> CausalLMOnMeta:
    """The causal LM of the config at ``path`` (:func:`is_hf_config`), its parameters on meta in
    ``precision``'s dtype (:data:`PRECISIONS`, whatever dtype the config names), with
    ``use_cache=False`` as training needs, and a batch of ``batch_size`` sequences of
    ``sequence_length`` random token ids, their ``labels`` the same ids."""
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
    return CausalLMOnMeta(model, {"input_ids": ids, "labels": ids})
