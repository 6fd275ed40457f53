"""The one interface every model runner implements, and the slot-indexed KV cache.

A runner holds `num_slots` request slots. Each forward call names, per batch row, the slot and the
absolute positions of the tokens it feeds; keys/values are written at those positions, and a query at
position p attends to keys at positions <= p of its own slot. Rolling back rejected draft tokens is
therefore nothing at all: the caller just feeds the next tokens at the earlier positions and the stale
entries are overwritten (or never attended to, being beyond the query's position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know about a loaded model."""

    name: str  # a human-readable name (folder name)
    path: str  # where it was loaded from
    vocab_size: int  # rows of the output layer (may exceed the tokenizer's size: padding rows)
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int
    architecture: str  # e.g. "LlamaForCausalLM"
    num_parameters: int
    fast_path: bool  # True: the pure-torch Llama-family runner; False: the generic HF fallback
    # Reduced draft vocabulary (models/draft_vocab.py): logit j is token output_token_ids[j]; the model
    # takes token ids < input_vocab_size. None: logit j is token j and input ids < vocab_size.
    output_token_ids: tuple[int, ...] | None = None
    input_vocab_size: int | None = None


def warmup(model: object, max_batch: int, max_tokens: int | None = None, layers: tuple[int, ...] = (),
           tree: bool = False) -> int:
    """Let a runner prepare its step shapes before traffic (the CUDA graph path captures every graph that calls
    of up to `max_batch` rows x `max_tokens` tokens use; None: every token count it captures; with `layers`, those
    of `forward_features` for a feature head's layers; with `tree`, those of token-tree verify calls). Runners
    without that (eager, CPU) have nothing to do. Returns the graphs captured."""
    warm = getattr(model, "warmup", None)
    if warm is None:
        return 0
    extra = {**({"layers": layers} if layers else {}), **({"tree": True} if tree else {})}
    return warm(max_batch, max_tokens, **extra)


class CausalLM(Protocol):
    """A causal LM with a slot-indexed KV cache."""

    info: ModelInfo

    def allocate(self, num_slots: int, max_len: int) -> None:
        """(Re)allocate the KV cache: `num_slots` requests of up to `max_len` positions each."""

    @property
    def num_slots(self) -> int: ...

    @property
    def max_len(self) -> int: ...

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] int64 token ids (rows may be right-padded with any id)
        positions: torch.Tensor,  # [B] int64 absolute position of tokens[:, 0] (row b feeds pos..pos+T-1)
        slots: torch.Tensor,  # [B] int64 cache slot of each row (distinct)
        logits_from: int = 0,  # return logits for tokens[:, logits_from:] only (prefill: T-1)
    ) -> torch.Tensor:  # [B, T - logits_from, V] float32 logits
        """Run the model, writing K/V of every fed token into the cache at (slot, position)."""
