"""Reduced draft vocabulary (FR-Spec / EAGLE-3 style) for drafter folders made by `specserve distill`.

A folder holding `draft_vocab.safetensors` (int64 tensor `token_ids` [V'], metadata `target_vocab_size`)
is a model whose vocabulary rows are: row j < V' = target token token_ids[j], row V' = "any other token".
Loaded models then take target token ids in (mapped to rows; unknown ids -> row V') and return logits
over the V' draft tokens only; `ModelInfo.output_token_ids` maps logit index j -> token id.

Exactness: the drafter proposes from, and ships, a distribution over these tokens only; the verifier
uses exactly that distribution, so speculative sampling still yields the target's distribution.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def read_draft_vocab(folder: str | Path) -> tuple[torch.Tensor, int] | None:
    """(token_ids [V'] int64, target vocabulary size), or None when the folder has no draft vocabulary."""
    from safetensors import safe_open

    f = Path(folder) / DRAFT_VOCAB_FILE
    if not f.exists():
        return None
    with safe_open(str(f), framework="pt") as s:
        token_ids = s.get_tensor("token_ids").to(torch.int64)
        meta = s.metadata() or {}
    if "target_vocab_size" not in meta:
        raise ValueError(f"{f}: metadata lacks target_vocab_size")
    target_vocab = int(meta["target_vocab_size"])
    if token_ids.dim() != 1 or len(token_ids) == 0 or int(token_ids.min()) < 0 or int(token_ids.max()) >= target_vocab:
        raise ValueError(f"{f}: token_ids must be a non-empty [V'] tensor of ids < {target_vocab}")
    if len(torch.unique(token_ids)) != len(token_ids):
        raise ValueError(f"{f}: token_ids has duplicates")
    return token_ids, target_vocab


def input_map(token_ids: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """[target_vocab] int64: target token id -> vocabulary row (V' for tokens outside the draft vocabulary)."""
    m = torch.full((target_vocab,), len(token_ids), dtype=torch.int64)
    m[token_ids] = torch.arange(len(token_ids))
    return m


class MappedEmbedding(nn.Module):
    """An embedding looked up by target token id through `input_map`."""

    def __init__(self, embedding: nn.Embedding, id_to_row: torch.Tensor) -> None:
        super().__init__()
        self.embedding = embedding
        self.register_buffer("id_to_row", id_to_row.to(embedding.weight.device), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [B, T] target ids -> [B, T, C]
        return self.embedding(self.id_to_row[ids])


def output_rows(weight: torch.Tensor, num_rows: int) -> nn.Linear:
    """A bias-free output layer over the first `num_rows` rows of `weight` (shares its storage)."""
    layer = nn.Linear(weight.shape[1], num_rows, bias=False, device="meta")
    layer.weight = nn.Parameter(weight[:num_rows], requires_grad=False)
    return layer
