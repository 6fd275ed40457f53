"""What a feature head reads from the frozen target, computed once per batch and kept for every later epoch.

A head's training step needs, per position t of a batch, the target's states that feed it (EAGLE-3: the inputs of
three of its layers, concatenated; Medusa: the final normed state) and the target's next-token distribution (the
teacher). Both come from one teacher-forced pass of the target; the target is frozen, so they are the same in
every epoch and the pass is paid once: `FeatureCache` keeps each batch's `HeadBatch` on the training device while
its byte budget lasts, then in (pinned) host memory, and recomputes only what fits in neither.

The teacher is kept as its top `k` entries over the head's output rows (the draft vocabulary for EAGLE-3, the
whole vocabulary for Medusa), renormalised over those k: the loss is the cross-entropy to that truncated
distribution. For a small target the top 32 hold nearly all the mass, and the cache stays ~30x smaller than the
target's full-vocabulary log-probabilities would be.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, fields
from typing import Any, Callable, ContextManager

import torch

from pipeline.distill.target import output_weight


@dataclass
class HeadBatch:
    ids: torch.Tensor  # [B, T] int64 target ids, right-padded with 0
    weights: torch.Tensor  # [B, T] float32 loss weight of the prediction made at t (for t + 1); 0 on padding
    feats: torch.Tensor  # [B, T, F] the target states the head reads (target dtype)
    teacher_idx: torch.Tensor  # [B, T, k] int32 the teacher's top-k at t, as rows of the head's output
    teacher_logp: torch.Tensor  # [B, T, k] float16 their log-probabilities, renormalised over the k

    def to(self, device: torch.device, non_blocking: bool = False) -> "HeadBatch":
        return HeadBatch(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)})

    def pin(self) -> "HeadBatch":
        return HeadBatch(**{f.name: getattr(self, f.name).pin_memory() for f in fields(self)})

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, f.name).nbytes for f in fields(self))


@torch.no_grad()
def teacher_topk(
    target: Any,
    hidden: torch.Tensor,  # [N, C] final normed states
    rows: torch.Tensor | None,  # [V'] the head's output rows as target ids, or None for the whole vocabulary
    k: int,
    chunk: int = 8192,
) -> tuple[torch.Tensor, torch.Tensor]:  # [N, k] int32 row indices, [N, k] float16 log-probs (sum of probs = 1)
    """The target's distribution at each position, restricted to `rows`, truncated to its top k, renormalised."""
    weight = output_weight(target)
    if rows is not None:
        weight = weight[rows]
    k = min(k, weight.shape[0])
    idx, logp = [], []
    for i in range(0, hidden.shape[0], chunk):
        logits = (hidden[i : i + chunk] @ weight.T).float()  # [n, V']
        top, at = logits.topk(k, dim=-1)  # sorted: column 0 is the teacher's argmax
        idx.append(at.to(torch.int32))
        logp.append(torch.log_softmax(top, dim=-1).to(torch.float16))
    return torch.cat(idx), torch.cat(logp)


@torch.no_grad()
def target_features(
    target: Any,
    ids: torch.Tensor,  # [B, T] int64
    weights: torch.Tensor,  # [B, T] float32
    layers: tuple[int, ...] | None,  # EAGLE-3: the target layers whose input states are fused; None: Medusa
    rows: torch.Tensor | None,
    k: int,
    autocast: ContextManager | None = None,
) -> HeadBatch:
    """One teacher-forced target pass -> what the head trains on at every position of the batch."""
    B, T = ids.shape
    with autocast or nullcontext():
        out = target.model(input_ids=ids, use_cache=False, output_hidden_states=True)
    states = out.hidden_states  # HF: the embeddings, each layer's output, the last one after the final norm
    last = out.last_hidden_state
    feats = torch.cat([states[i] for i in layers], dim=-1) if layers is not None else last
    t_idx, t_logp = teacher_topk(target, last.reshape(B * T, -1), rows, k)
    return HeadBatch(ids, weights, feats.contiguous(), t_idx.view(B, T, -1), t_logp.view(B, T, -1))


class FeatureCache:
    """`get(i)`: batch i's `HeadBatch` on `device`, computed by `make(i)` the first time and kept after that: on
    the device while `device_bytes` last, then in host memory (pinned when the device is a GPU) while
    `host_bytes` last; beyond both it is recomputed on every visit."""

    def __init__(self, make: Callable[[int], HeadBatch], device: torch.device, device_bytes: float,
                 host_bytes: float) -> None:
        self.make, self.device = make, device
        self.budget = {"device": float(device_bytes), "host": float(host_bytes)}
        self.used = {"device": 0, "host": 0}
        self.entries: dict[int, HeadBatch] = {}
        self.computed = 0  # target passes made

    def get(self, i: int) -> HeadBatch:
        hit = self.entries.get(i)
        if hit is not None:
            return hit.to(self.device, non_blocking=True)
        b = self.make(i)
        self.computed += 1
        n = b.nbytes
        if self.used["device"] + n <= self.budget["device"]:
            self.entries[i] = b
            self.used["device"] += n
        elif self.used["host"] + n <= self.budget["host"]:
            host = b.to(torch.device("cpu"))
            self.entries[i] = host.pin() if self.device.type == "cuda" else host
            self.used["host"] += n
        return b

    def stats(self) -> dict[str, Any]:
        return {"batches": len(self.entries), "target_passes": self.computed,
                "device_gb": round(self.used["device"] / 2**30, 2), "host_gb": round(self.used["host"] / 2**30, 2)}
