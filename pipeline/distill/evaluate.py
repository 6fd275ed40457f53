"""How many tokens per target pass a drafter would give, measured on the target's own answers.

Greedy is exact, with no decoding loop: at K draft tokens per pass, the pass starting at answer position
i drafts from context prompt + answer[:i]. While drafts match, each next draft's context is again a
prefix of the answer, so one teacher-forced drafter forward over prompt + answer gives every draft that
can matter (`match[i]`: the drafter's argmax at i equals answer[i]). A pass accepts the run of matches
from i (at most K) and emits one more token (recovered or bonus): tokens per pass = answer length /
number of passes, the figure speculative decoding reports ("mean accepted tokens", bonus included).

Sampled (temperature T) decoding is estimated: at each position of a sampled target answer the draft
token is accepted with probability alpha_i = sum_x min(p_i(x), q_i(x)) (Leviathan et al. 2023), with p
the target's and q the drafter's warped distribution, q cut to its top-k as the engine ships it. Passes
are then simulated with seeded uniforms. The exact figure comes from running the engine (`specserve bench`).
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pipeline.distill.drafter import DraftModel
from pipeline.distill.generate import SampleSet


@dataclass
class Acceptance:
    """Totals over a set of answers."""

    tokens: int = 0  # answer tokens emitted
    passes: int = 0  # target passes
    reached: list[int] = field(default_factory=list)  # [K] drafts verified at each draft position
    accepted: list[float] = field(default_factory=list)  # [K] drafts accepted at each draft position

    def add(self, other: "Acceptance") -> None:
        self.tokens += other.tokens
        self.passes += other.passes
        if not self.reached:
            self.reached, self.accepted = [0] * len(other.reached), [0.0] * len(other.accepted)
        self.reached = [a + b for a, b in zip(self.reached, other.reached)]
        self.accepted = [a + b for a, b in zip(self.accepted, other.accepted)]

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / max(self.passes, 1)

    def summary(self) -> dict[str, Any]:
        return {
            "tokens_per_pass": round(self.tokens_per_pass, 4),
            "tokens": self.tokens,
            "passes": self.passes,
            "accept_by_position": [round(a / r, 4) if r else None for a, r in zip(self.accepted, self.reached)],
        }


def simulate(accept_prob: np.ndarray, k: int, rng: np.random.Generator | None = None) -> Acceptance:
    """Passes over one answer: `accept_prob[i]` is the chance the draft at answer position i is accepted
    (0/1 for greedy, alpha_i for sampled; then `rng` draws the outcomes)."""
    n = len(accept_prob)
    res = Acceptance(tokens=n, reached=[0] * k, accepted=[0] * k)
    pos = 0
    while pos < n:
        j = 0
        while j < k and pos + j < n:
            res.reached[j] += 1
            p = accept_prob[pos + j]
            ok = bool(p >= 1.0) if rng is None else bool(rng.random() < p)
            if not ok:
                break
            res.accepted[j] += 1
            j += 1
        pos += j + 1  # the accepted drafts plus one recovered/bonus token
        res.passes += 1
    return res


def _batches(data: SampleSet, batch_tokens: int) -> list[list[int]]:
    order = np.argsort(data.lengths, kind="stable")
    out, cur, width = [], [], 0
    for i in order.tolist():
        width = max(width, int(data.lengths[i]))
        if cur and (len(cur) + 1) * width > batch_tokens:
            out.append(cur)
            cur, width = [], int(data.lengths[i])
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def _padded(data: SampleSet, idx: list[int], device: torch.device) -> torch.Tensor:
    width = max(int(data.lengths[i]) for i in idx)
    ids = torch.zeros((len(idx), width), dtype=torch.long)
    for r, i in enumerate(idx):
        s = data.seq(i)
        ids[r, : len(s)] = torch.from_numpy(s.astype(np.int64))
    return ids.to(device)


@torch.no_grad()
def draft_accept_probs(
    draft: DraftModel,
    data: SampleSet,
    *,
    target: Any = None,  # needed when temperature > 0
    temperature: float = 0.0,
    top_k: int = 64,
    batch_tokens: int = 32768,
    autocast_dtype: torch.dtype | None = None,
) -> list[np.ndarray]:
    """Per answer: acceptance probability of the draft at each answer position (see module docstring)."""
    from pipeline.distill.target import output_weight

    device = next(draft.parameters()).device
    out: list[np.ndarray] = [np.zeros(0)] * len(data)
    ac = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
    for idx in _batches(data, batch_tokens):
        ids = _padded(data, idx, device)
        with ac:
            d_hidden = draft.hidden(ids)  # [B, T, H]
            t_hidden = target.model(input_ids=ids, use_cache=False).last_hidden_state if temperature > 0 else None
        for r, i in enumerate(idx):
            plen, n = int(data.prompt_lens[i]), int(data.lengths[i])
            pred_pos = torch.arange(plen - 1, n - 1, device=device)  # position t predicts token t+1
            answer = ids[r, plen:n]  # [n_ans]
            d_logits = draft.logits(d_hidden[r, pred_pos].float())  # [n_ans, V']
            if temperature <= 0:
                match = draft.to_token_ids(d_logits.argmax(-1)) == answer
                out[i] = match.float().cpu().numpy()
                continue
            q = torch.softmax(d_logits / temperature, dim=-1)
            kk = min(top_k, q.shape[-1])
            q_top, rows = q.topk(kk, dim=-1)  # [n_ans, k]
            q_top = q_top / q_top.sum(-1, keepdim=True)
            t_logits = (t_hidden[r, pred_pos].float() @ output_weight(target).float().T)  # [n_ans, V]
            p = torch.softmax(t_logits / temperature, dim=-1)
            p_at = p.gather(-1, draft.to_token_ids(rows))  # [n_ans, k]
            out[i] = torch.minimum(p_at, q_top).sum(-1).clamp(max=1.0).cpu().numpy()
    return out


def acceptance_report(data: SampleSet, probs: list[np.ndarray], k: int, sampled: bool, seed: int = 0) -> dict:
    """Overall and per-category tokens per pass and acceptance by draft position."""
    rng = np.random.default_rng(seed) if sampled else None
    total = Acceptance()
    by_cat: dict[str, Acceptance] = defaultdict(Acceptance)
    agree, n_pos = 0.0, 0
    for i, p in enumerate(probs):
        a = simulate(p, k, rng)
        total.add(a)
        by_cat[data.names[int(data.category[i])]].add(a)
        agree += float(p.sum())
        n_pos += len(p)
    rep = total.summary()
    rep["per_token_accept"] = round(agree / max(n_pos, 1), 4)  # top-1 agreement (greedy) / mean alpha (sampled)
    rep["by_category"] = {c: round(a.tokens_per_pass, 4) for c, a in sorted(by_cat.items())}
    return rep


def evaluate(draft: DraftModel, sets: dict[str, tuple[SampleSet, float]], *, target: Any, k: int, top_k: int,
             batch_tokens: int = 32768, autocast_dtype: torch.dtype | None = None, seed: int = 0) -> dict:
    """{name: report} for each (answers, temperature) set."""
    was_training = draft.training
    draft.eval()
    out = {}
    for name, (data, temp) in sets.items():
        probs = draft_accept_probs(draft, data, target=target, temperature=temp, top_k=top_k,
                                   batch_tokens=batch_tokens, autocast_dtype=autocast_dtype)
        out[name] = acceptance_report(data, probs, k, sampled=temp > 0, seed=seed)
        out[name]["temperature"] = temp
    draft.train(was_training)
    return out
