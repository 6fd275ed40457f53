"""Token-level distillation: the drafter learns the target's next-token distribution on the target's
own answers (forward KL; the target's probabilities are computed on the fly, over its full vocabulary,
and restricted to the draft tokens).

Loss per position t (predicting token t+1):  -sum_j p_target(token_ids[j]) * log q_draft(j),
i.e. KL(p_target || q_draft) up to a constant, weighted 1 where token t+1 is part of the target's answer,
`prompt_weight` where it is part of the prompt, and 0 on padding. Several drafter variants can be trained
at once on the same batches and target labels (the target's forward is most of the cost).
"""

from __future__ import annotations

import math
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.distill.config import DistillConfig
from pipeline.distill.drafter import DraftModel
from pipeline.distill.generate import SampleSet
from pipeline.distill.target import target_log_probs


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] int64 target ids, right-padded with 0
    weights: torch.Tensor  # [B, T] float32 loss weight of the prediction made at position t (for t+1)
    is_answer: torch.Tensor  # [B, T] bool: token t+1 belongs to the target's answer


def epoch_batches(lengths: np.ndarray, batch_tokens: int, max_seq_len: int, seed: int) -> list[list[int]]:
    """Index batches of similar length (padded size <= batch_tokens), in a seeded random order."""
    rng = random.Random(seed)
    lens = np.minimum(lengths, max_seq_len)
    noise = np.asarray([rng.random() for _ in range(len(lens))])
    order = np.lexsort((noise, lens))  # by length, random among equal lengths
    out, cur, width = [], [], 0
    for i in order.tolist():
        w = max(width, int(lens[i]))
        if cur and (len(cur) + 1) * w > batch_tokens:
            out.append(cur)
            cur, w = [], int(lens[i])
        cur.append(i)
        width = w
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def collate(data: SampleSet, idx: list[int], max_seq_len: int, prompt_weight: float) -> Batch:
    seqs, plens = [], []
    for i in idx:
        s, plen = data.seq(i), int(data.prompt_lens[i])
        if len(s) > max_seq_len:  # keep the end (the answer), cut the prompt's beginning
            cut = len(s) - max_seq_len
            s, plen = s[cut:], max(plen - cut, 1)
        seqs.append(s)
        plens.append(plen)
    width = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    weights = torch.zeros((len(seqs), width), dtype=torch.float32)
    is_answer = torch.zeros((len(seqs), width), dtype=torch.bool)
    for r, (s, plen) in enumerate(zip(seqs, plens)):
        n = len(s)
        ids[r, :n] = torch.from_numpy(s.astype(np.int64))
        # position t predicts token t+1: answer tokens are t+1 >= plen, i.e. t >= plen - 1
        weights[r, : plen - 1] = prompt_weight
        weights[r, plen - 1 : n - 1] = 1.0
        is_answer[r, plen - 1 : n - 1] = True
    return Batch(ids, weights, is_answer)


def lr_at(step: int, cfg: DistillConfig, total: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


class Trainer:
    """Trains every variant on the same stream of batches; resumable from `checkpoint.pt`."""

    def __init__(self, cfg: DistillConfig, target: Any, variants: dict[str, DraftModel], data: SampleSet,
                 token_ids: torch.Tensor | None, work: Path, device: torch.device) -> None:
        self.cfg, self.target, self.variants, self.data = cfg, target, variants, data
        self.work, self.device = work, device
        self.rows = None if token_ids is None else token_ids.to(device)
        self.autocast = torch.autocast(device.type, dtype=getattr(torch, cfg.dtype)) if cfg.dtype != "float32" else None
        self.opts = {
            name: torch.optim.AdamW(v.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                                    fused=device.type == "cuda")
            for name, v in variants.items()
        }
        self.step, self.total_steps = 0, cfg.steps
        self.tokens_seen, self.answer_tokens_seen = 0, 0
        self.history: list[dict] = []
        self.ckpt = work / "checkpoint.pt"
        self._epochs: dict[int, list[list[int]]] = {}
        self._per_epoch: int | None = None

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self) -> None:
        state = {
            "step": self.step, "total_steps": self.total_steps, "tokens_seen": self.tokens_seen,
            "answer_tokens_seen": self.answer_tokens_seen, "history": self.history,
            "variants": {n: v.lm.state_dict() for n, v in self.variants.items()},
            "opts": {n: o.state_dict() for n, o in self.opts.items()},
        }
        tmp = self.ckpt.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(self.ckpt)

    def maybe_resume(self) -> bool:
        if not self.ckpt.exists():
            return False
        state = torch.load(self.ckpt, map_location=self.device, weights_only=False)
        if set(state["variants"]) != set(self.variants):
            raise ValueError(f"checkpoint {self.ckpt} holds variants {sorted(state['variants'])}, "
                             f"this run trains {sorted(self.variants)}: use another --out or remove it")
        for n, v in self.variants.items():
            v.lm.load_state_dict(state["variants"][n])
            self.opts[n].load_state_dict(state["opts"][n])
        self.step, self.total_steps = state["step"], state["total_steps"]
        self.tokens_seen, self.answer_tokens_seen = state["tokens_seen"], state["answer_tokens_seen"]
        self.history = state["history"]
        return True

    # -- one step ------------------------------------------------------------------------------
    def _batch(self, step: int) -> Batch:
        """The batch of global step `step` (each epoch reshuffled with seed + epoch)."""
        if self._per_epoch is None:
            self._per_epoch = len(self._epoch(0))
        epoch, j = divmod(step, self._per_epoch)
        batches = self._epoch(epoch)
        return collate(self.data, batches[j % len(batches)], self.cfg.max_seq_len, self.cfg.prompt_weight)

    def _epoch(self, e: int) -> list[list[int]]:
        if e not in self._epochs:  # keep one epoch's order at a time
            self._epochs = {e: epoch_batches(self.data.lengths, self.cfg.batch_tokens, self.cfg.max_seq_len,
                                             self.cfg.seed * 7919 + e)}
        return self._epochs[e]

    def train_step(self) -> dict[str, float]:
        cfg, dev = self.cfg, self.device
        b = self._batch(self.step)
        ids, w, is_ans = b.input_ids.to(dev), b.weights.to(dev), b.is_answer.to(dev)
        sel = w > 0  # [B, T]
        w_sel, ans_sel = w[sel], is_ans[sel]  # [N]
        with torch.no_grad(), self._ac():
            t_hidden = self.target.model(input_ids=ids, use_cache=False).last_hidden_state  # [B, T, H]
        t_logp, t_top = target_log_probs(self.target, t_hidden[sel], self.rows)  # [N, V'], [N]
        del t_hidden
        t_prob = t_logp.exp()
        in_vocab_top = None
        if self.rows is not None:  # where the target's argmax is a draft token, which row it is
            pos = torch.full((self.target.config.vocab_size,), -1, dtype=torch.long, device=dev)
            pos[self.rows] = torch.arange(len(self.rows), device=dev)
            in_vocab_top = pos[t_top]
        lr = lr_at(self.step, cfg, self.total_steps)
        metrics: dict[str, float] = {"lr": lr}
        for name, draft in self.variants.items():
            opt = self.opts[name]
            for g in opt.param_groups:
                g["lr"] = lr
            with self._ac():
                d_hidden = draft.hidden(ids)  # [B, T, H]
                logits = draft.logits(d_hidden[sel])  # [N, V']
            logq = F.log_softmax(logits.float(), dim=-1)
            ce = -(t_prob * logq).sum(-1)  # [N]
            loss = (w_sel * ce).sum() / w_sel.sum()
            if cfg.hard_weight > 0:
                tgt = t_top if in_vocab_top is None else in_vocab_top
                ok = tgt >= 0
                nll = F.nll_loss(logq[ok], tgt[ok], reduction="none")
                loss = loss + cfg.hard_weight * (w_sel[ok] * nll).sum() / w_sel.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
            opt.step()
            with torch.no_grad():
                kl = (t_prob[ans_sel] * (t_logp[ans_sel] - logq[ans_sel])).sum(-1).mean()
                agree = (draft.to_token_ids(logits[ans_sel].argmax(-1)) == t_top[ans_sel]).float().mean()
            metrics[f"{name}/loss"] = float(loss.detach())
            metrics[f"{name}/kl"] = float(kl)
            metrics[f"{name}/agree"] = float(agree)
        self.tokens_seen += int(sel.sum())
        self.answer_tokens_seen += int(is_ans.sum())
        self.step += 1
        return metrics

    def _ac(self):
        return self.autocast if self.autocast is not None else nullcontext()

    # -- the loop ------------------------------------------------------------------------------
    def run(self, evaluate: Callable[[], dict], progress: Callable[[str], None] = print) -> list[dict]:
        from tqdm.auto import tqdm

        cfg = self.cfg
        for v in self.variants.values():
            v.train()
        first = self.variants and next(iter(self.variants))
        if cfg.train_seconds is not None and self.step == 0:
            # Fix the step count (and so the LR schedule) from measured throughput, within warmup.
            probe = min(25, max(1, cfg.warmup_steps // 2))
            self.total_steps = 10**9
            for _ in range(min(5, probe)):  # allocator growth and kernel selection happen here
                self.train_step()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(probe):
                self.train_step()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.perf_counter() - t0) / probe
            self.total_steps = max(self.step + 1, int(cfg.train_seconds / per_step))
            progress(f"{per_step * 1000:.0f} ms/step -> {self.total_steps} steps for {cfg.train_seconds:.0f} s")
        bar = tqdm(total=self.total_steps, initial=self.step, desc="distill", dynamic_ncols=True, mininterval=2.0)
        last_eval: dict = {}
        window: list[dict[str, float]] = []
        while self.step < self.total_steps:
            m = self.train_step()
            window = (window + [m])[-20:]
            bar.update(1)
            done = self.step >= self.total_steps
            if self.step % cfg.eval_every == 0 or done:
                last_eval = evaluate()
                for v in self.variants.values():
                    v.train()
                self.history.append({"step": self.step, "tokens_seen": self.tokens_seen,
                                     "answer_tokens_seen": self.answer_tokens_seen, "eval": last_eval})
                progress(f"step {self.step}: " + "; ".join(
                    f"{n}: " + ", ".join(f"{s} {r['tokens_per_pass']:.3f}" for s, r in ev.items())
                    for n, ev in last_eval.items()))
            if self.step % cfg.ckpt_every == 0 or done:
                self.save()
            if self.step % 5 == 0 or done:
                avg = {k: sum(x[k] for x in window) / len(window) for k in window[-1]}
                post = {"loss": f"{avg[f'{first}/loss']:.3f}", "acc": f"{avg[f'{first}/agree']:.3f}"}
                ev = last_eval.get(first, {})
                if ev:
                    post["tok/pass"] = f"{next(iter(ev.values()))['tokens_per_pass']:.2f}"
                bar.set_postfix(post, refresh=False)
        bar.close()
        return self.history
