"""Fallback runner for any `AutoModelForCausalLM` architecture the Llama fast path does not cover.

Each slot owns an HF `DynamicCache`. A row at position p first crops its slot's cache to p tokens (this
is the rollback of rejected drafts), then feeds its tokens. Rows run one at a time: correct for every
architecture HF supports, not fast. Use it to serve odd models, not to benchmark.

Every attention layer keeps all its positions, sliding-window layers (Gemma 2/3, Qwen with windows) included:
transformers' sliding-window cache layers drop what falls out of the window, which makes a rollback past the
window impossible (`crop`). The sliding layers' mask still hides those keys, so the logits are the same.
"""

from __future__ import annotations

import inspect
import logging
import warnings

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from pipeline.models.base import ModelInfo
from pipeline.models.families import FAMILIES

log = logging.getLogger(__name__)
_warned = False


class HFGenericCausalLM:
    """`CausalLM` around an HF causal LM, with one `DynamicCache` per slot."""

    def __init__(self, model: nn.Module, info: ModelInfo) -> None:
        global _warned
        if not _warned:
            warnings.warn(
                f"{info.architecture}: using the generic HF runner (slow: rows run one at a time); "
                f"the fast path covers model_type {', '.join(FAMILIES)}",
                stacklevel=2,
            )
            _warned = True
        self.model = model.eval().requires_grad_(False)
        self.info = info
        self.device = next(model.parameters()).device
        self._caches: list[DynamicCache] = []
        self._max_len = 0
        params = inspect.signature(model.forward).parameters
        self._keeps_logits = "logits_to_keep" in params
        # transformers >= 5.2x names the cache argument `cache` (older: `past_key_values`, deprecated since).
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @property
    def num_slots(self) -> int:
        return len(self._caches)

    @property
    def max_len(self) -> int:
        return self._max_len

    def allocate(self, num_slots: int, max_len: int) -> None:
        assert num_slots >= 1 and max_len >= 1, f"need num_slots, max_len >= 1, got {num_slots}, {max_len}"
        self._caches = [self._new_cache() for _ in range(num_slots)]
        self._max_len = max_len

    def _new_cache(self) -> DynamicCache:
        """The model's `DynamicCache`, with every sliding-window layer replaced by one that keeps every position
        (so that `crop` can roll back past the window)."""
        cache = DynamicCache(config=self.model.config)
        cache.layers = [DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer
                        for layer in cache.layers]
        return cache

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor,  # [B] int64 position of tokens[:, 0]
        slots: torch.Tensor,  # [B] int64 distinct cache slots
        logits_from: int = 0,
    ) -> torch.Tensor:  # [B, T - logits_from, V] float32
        assert self._caches, "call allocate(num_slots, max_len) before forward"
        assert tokens.dim() == 2, f"tokens must be [B, T], got {tuple(tokens.shape)}"
        B, T = tokens.shape
        assert 0 <= logits_from < T, f"logits_from must be in [0, {T}), got {logits_from}"
        tokens = tokens.to(self.device)
        out = []
        for b, (pos, slot) in enumerate(zip(positions.tolist(), slots.tolist())):
            assert pos + T <= self._max_len, f"positions + T = {pos + T} exceeds max_len {self._max_len}"
            cache = self._caches[slot]
            cached = cache.get_seq_length()
            assert pos <= cached, f"slot {slot}: position {pos} is past the {cached} cached tokens (a gap)"
            if cached > pos:
                cache.crop(pos - cached)  # negative: drop that many tokens (same meaning on transformers 5.x)
            position_ids = torch.arange(pos, pos + T, device=self.device)[None]  # [1, T]
            kwargs = {self._cache_arg: cache, "use_cache": True}
            if self._keeps_logits:
                kwargs["logits_to_keep"] = T - logits_from
            logits = self.model(input_ids=tokens[b : b + 1], position_ids=position_ids, **kwargs).logits  # [1, T|T', V]
            out.append(logits[0, -(T - logits_from) :].float())
        return torch.stack(out)  # [B, T', V]

    __call__ = forward
