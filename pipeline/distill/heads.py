"""`specserve distill --method eagle3|medusa`: train a feature head on the target's own answers.

The data, the draft vocabulary and the evaluation references are the ones `run.distill` makes for a draft model;
here the target's teacher-forced pass over each batch gives both the head's input (its hidden states) and the
labels (its next-token distributions), and the head learns forward KL to them, weighted as for a draft model.

- EAGLE-3 (training-time test, Li et al. 2025): every position acts as the last committed one and the head drafts
  `head_depth` tokens on from its own outputs (`Eagle3Head.train_forward`); depth d at position p learns the
  target's distribution at p+1+d, reading the true token there (a draft is only used while the earlier ones were
  accepted, i.e. equal to the truth).
- Medusa (Medusa-1: the target frozen): head i at position p learns the target's distribution at p+1+i; the heads
  share the target's output layer, so only their residual blocks are trained and stored.

Evaluation is exact for greedy decoding and needs no decoding loop: the head's greedy chain at an answer position
is what the teacher-forced forward predicts while every earlier draft matched, so a pass accepts the run of
matches from there (`simulate_chain`), as `evaluate.py` does for draft models.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.distill.config import DistillConfig
from pipeline.distill.evaluate import Acceptance, _batches, _padded
from pipeline.distill.generate import SampleSet
from pipeline.distill.target import DTYPES, output_weight, target_log_probs
from pipeline.distill.train import collate, epoch_batches, lr_at
from pipeline.heads.eagle3 import Eagle3Config, Eagle3Head, save_eagle3
from pipeline.heads.medusa import MedusaConfig, MedusaHeads, save_medusa


def build_head(cfg: DistillConfig, target: Any, token_ids: torch.Tensor | None) -> torch.nn.Module:
    """A head for the HF target, initialised from it where shapes allow (EAGLE-3: the output rows of the draft
    tokens and the final norm; Medusa: zero residual blocks, so each head starts as the target's own output)."""
    c = target.config
    n_layers = c.num_hidden_layers
    out_w = output_weight(target).detach()
    if cfg.method == "medusa":
        heads = MedusaHeads(MedusaConfig(cfg.medusa_heads, cfg.medusa_layers, shared_lm_head=True), c.hidden_size,
                            c.vocab_size, out_w.float())
        for seq in heads.blocks:
            for block in seq:
                torch.nn.init.zeros_(block.linear.weight)
                torch.nn.init.zeros_(block.linear.bias)
        return heads
    aux = tuple(cfg.aux_layers) if cfg.aux_layers else None
    layers = aux or (2, n_layers // 2, n_layers - 3)
    if min(layers) < 0 or max(layers) >= n_layers:
        raise ValueError(f"EAGLE-3 layers {layers} must lie in [0, {n_layers}) for a {n_layers}-layer target")
    rows = token_ids if token_ids is not None else torch.arange(c.vocab_size)
    hcfg = Eagle3Config(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                        num_key_value_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                        intermediate_size=c.intermediate_size, vocab_size=c.vocab_size, draft_vocab_size=len(rows),
                        rms_norm_eps=c.rms_norm_eps, rope_theta=getattr(c, "rope_theta", None) or 10000.0,
                        head_dim=getattr(c, "head_dim", None), aux_layers=aux)
    head = Eagle3Head(hcfg, target.get_input_embeddings().weight.detach().float())
    with torch.no_grad():
        head.lm_head.weight.copy_(out_w[rows.to(out_w.device)].float())
        head.norm.copy_(target.model.norm.weight.float())
        head.d2t.copy_(rows.cpu() - torch.arange(len(rows)))
    return head


def head_layers(head: torch.nn.Module, n_layers: int) -> tuple[int, ...]:
    return head.cfg.layers_for(n_layers) if isinstance(head, Eagle3Head) else ()


def _shift(x: torch.Tensor, s: int) -> torch.Tensor:  # [B, T, ...] -> x[:, s:] padded with zeros at the end
    return torch.cat([x[:, s:], torch.zeros_like(x[:, :s])], dim=1)


def head_loss(head: torch.nn.Module, target: Any, ids: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor | None,
              depth: int, autocast) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward KL to the target's distributions at every depth (EAGLE-3) or head (Medusa) -> (loss, metrics)."""
    B, T = ids.shape
    eagle = isinstance(head, Eagle3Head)
    with torch.no_grad(), autocast:
        out = target.model(input_ids=ids, use_cache=False, output_hidden_states=True)
    states = out.hidden_states
    teacher_rows = rows if eagle else None  # Medusa heads write the target's whole vocabulary
    t_logp, _ = target_log_probs(target, out.last_hidden_state.reshape(B * T, -1), teacher_rows)
    t_prob = t_logp.exp().view(B, T, -1)  # [B, T, V'] the target's distribution at each position
    del out, t_logp
    with autocast:
        if eagle:
            feats = torch.cat([states[i] for i in head.cfg.layers_for(target.config.num_hidden_layers)], -1)
            outs = head.train_forward(_shift(ids, 1), feats, depth)
        else:
            hidden = head.hidden(states[-1].float())  # [B, T, K, C]
            outs = [head.logits(hidden[..., i, :], i) for i in range(head.num_heads)]
    losses, metrics = [], {}
    for d, logits in enumerate(outs):  # index p predicts the token after position p+1+d
        w = _shift(weights, 1 + d)
        teach = _shift(t_prob, 1 + d)
        logq = F.log_softmax(logits.float(), dim=-1)
        ce = -(teach * logq).sum(-1)  # [B, T]
        losses.append((w * ce).sum() / w.sum().clamp(min=1e-6))
        with torch.no_grad():
            ans = w >= 1.0
            agree = (logits.argmax(-1) == teach.argmax(-1))[ans].float().mean() if ans.any() else torch.zeros(())
        metrics[f"loss{d}"], metrics[f"agree{d}"] = float(losses[-1].detach()), float(agree)
    loss = torch.stack(losses).mean()
    metrics["loss"] = float(loss.detach())
    return loss, metrics


# -- evaluation -------------------------------------------------------------------------------------------------

def simulate_chain(match: np.ndarray, k: int) -> Acceptance:
    """Passes over one answer: `match[d, a]` whether the d-th draft of a pass starting at answer token a equals
    answer token a+d (given the earlier drafts of that pass matched)."""
    n = match.shape[1]
    res = Acceptance(tokens=n, reached=[0] * k, accepted=[0] * k)
    a = 0
    while a < n:
        j = 0
        while j < k and a + j < n:
            res.reached[j] += 1
            if not match[j, a]:
                break
            res.accepted[j] += 1
            j += 1
        a += j + 1
        res.passes += 1
    return res


@torch.no_grad()
def evaluate_head(head: torch.nn.Module, target: Any, sets: dict[str, tuple[SampleSet, float]], k: int,
                  autocast_dtype: torch.dtype | None = None, batch_tokens: int = 16384) -> dict[str, Any]:
    """Greedy tokens per target pass at K = k (bonus included), by draft position and category, per set."""
    was = head.training
    head.eval()
    device = next(head.parameters()).device
    ac = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
    eagle = isinstance(head, Eagle3Head)
    depth = k if eagle else min(k, head.num_heads)
    report = {}
    for name, (data, temp) in sets.items():
        if temp > 0:
            continue  # sampled acceptance of a head: measure it with the engine
        total, by_cat = Acceptance(), defaultdict(Acceptance)
        for idx in _batches(data, batch_tokens):
            ids = _padded(data, idx, device)
            with ac:
                states = target.model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
                if eagle:
                    feats = torch.cat([states[i] for i in head.cfg.layers_for(target.config.num_hidden_layers)], -1)
                    preds = [head.token_ids(o.argmax(-1)) for o in head.train_forward(_shift(ids, 1), feats, depth)]
                else:
                    hidden = head.hidden(states[-1].float())
                    preds = [head.logits(hidden[..., i, :], i).argmax(-1) for i in range(depth)]
            for r, i in enumerate(idx):
                plen, n = int(data.prompt_lens[i]), int(data.lengths[i])
                match = np.zeros((k, n - plen), dtype=bool)
                for d, pred in enumerate(preds):  # the pass at answer token t reads position t-2
                    if n - d <= plen:
                        break
                    t = torch.arange(plen, n - d, device=device)
                    match[d, : n - d - plen] = (pred[r, t - 2] == ids[r, t + d]).cpu().numpy()
                a = simulate_chain(match, k)
                total.add(a)
                by_cat[data.names[int(data.category[i])]].add(a)
        rep = total.summary()
        rep["by_category"] = {c: round(a.tokens_per_pass, 4) for c, a in sorted(by_cat.items())}
        report[name] = rep
    head.train(was)
    return report


# -- the run ----------------------------------------------------------------------------------------------------

EXPORT_DTYPE = torch.bfloat16  # the stored weights' dtype


def save_head(head: torch.nn.Module, folder: Path, meta: dict) -> None:
    save = save_eagle3 if isinstance(head, Eagle3Head) else save_medusa
    save(head, folder, EXPORT_DTYPE, meta={"specserve_distill": meta})


def train_head(cfg: DistillConfig, target: Any, data: SampleSet, token_ids: torch.Tensor | None,
               eval_sets: dict[str, tuple[SampleSet, float]], work: Path, device: torch.device,
               progress: Callable[[str], None] = print) -> tuple[torch.nn.Module, list[dict], int]:
    """Train (resumable from work/head_checkpoint.pt) -> (head, history, steps)."""
    from tqdm.auto import tqdm

    head = build_head(cfg, target, token_ids).to(device)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                            fused=device.type == "cuda")
    rows = None if token_ids is None else token_ids.to(device)
    ac_dtype = DTYPES[cfg.dtype] if cfg.dtype != "float32" else None
    autocast = torch.autocast(device.type, dtype=ac_dtype) if ac_dtype else nullcontext()
    ckpt = work / "head_checkpoint.pt"
    step, total, history = 0, cfg.steps, []
    if ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=False)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step, total, history = state["step"], state["total_steps"], state["history"]
    per_epoch: list[list[int]] = []

    def batch(s: int):
        nonlocal per_epoch
        if not per_epoch:
            per_epoch = epoch_batches(data.lengths, cfg.batch_tokens, cfg.max_seq_len, cfg.seed)
        b = collate(data, per_epoch[s % len(per_epoch)], cfg.max_seq_len, cfg.prompt_weight)
        return b.input_ids.to(device), b.weights.to(device)

    def one(s: int) -> dict[str, float]:
        for g in opt.param_groups:
            g["lr"] = lr_at(s, cfg, total)
        loss, m = head_loss(head, target, *batch(s), rows, cfg.head_depth, autocast)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        return m

    def evaluate() -> dict:
        return evaluate_head(head, target, eval_sets, cfg.eval_k, ac_dtype) if eval_sets else {}

    def save() -> None:
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "total_steps": total,
                    "history": history}, tmp)
        tmp.replace(ckpt)

    head.train()
    t_start = time.perf_counter()
    if cfg.train_seconds is not None and step == 0:  # fix the step count from measured throughput
        total = 10**9
        probe = max(2, min(10, cfg.warmup_steps // 2))
        for _ in range(2):
            one(step)
            step += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(probe):
            one(step)
            step += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        per_step = (time.perf_counter() - t0) / probe
        total = max(step + 1, int(cfg.train_seconds / per_step))
        progress(f"{per_step * 1000:.0f} ms/step -> {total} steps for {cfg.train_seconds:.0f} s")
    if step == 0 and eval_sets:
        history.append({"step": 0, "eval": evaluate()})
    bar = tqdm(total=total, initial=step, desc=f"distill {cfg.method}", dynamic_ncols=True, mininterval=2.0)
    window: list[dict[str, float]] = []
    while step < total:
        m = one(step)
        step += 1
        window = (window + [m])[-20:]
        bar.update(1)
        if cfg.train_seconds is not None and time.perf_counter() - t_start > cfg.train_seconds:
            total = step  # slower than the probe said (evaluations, a shared machine): stop within the budget
        done = step >= total
        if step % cfg.eval_every == 0 or done:
            avg = {k: round(sum(x[k] for x in window) / len(window), 4) for k in window[-1]}
            history.append({"step": step, "train": avg, "eval": evaluate()})
            ev = history[-1]["eval"]
            progress(f"step {step}: loss {avg['loss']:.3f} " + ", ".join(
                f"{s} {r['tokens_per_pass']:.3f}" for s, r in ev.items()))
        if step % cfg.ckpt_every == 0 or done:
            save()
        if step % 5 == 0 or done:
            bar.set_postfix({"loss": f"{sum(x['loss'] for x in window) / len(window):.3f}"}, refresh=False)
    bar.close()
    return head, history, step


def run_heads(cfg: DistillConfig, target: Any, data: SampleSet, token_ids: torch.Tensor | None,
              eval_sets: dict[str, tuple[SampleSet, float]], out: Path, meta: dict, timings: dict,
              progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Train, evaluate and export the head to `out` (+ metrics.json)."""
    device = next(target.parameters()).device
    t0 = time.perf_counter()
    head, history, steps = train_head(cfg, target, data, token_ids, eval_sets, out / "work", device, progress)
    timings["train_s"] = time.perf_counter() - t0
    ac = DTYPES[cfg.dtype] if cfg.dtype != "float32" else None
    with torch.no_grad():  # the final figures are those of the exported (bfloat16) weights
        for p in head.parameters():
            p.copy_(p.to(EXPORT_DTYPE).to(p.dtype))
    final = evaluate_head(head, target, eval_sets, cfg.eval_k, ac) if eval_sets else {}
    n_params = sum(p.numel() for p in head.parameters() if p.requires_grad)
    t_params = sum(p.numel() for n, p in target.named_parameters() if "embed" not in n)
    metrics = {**meta, "method": cfg.method, "final": final, "history": history, "steps": steps,
               "head_params": n_params, "cost_ratio": round(n_params / max(t_params, 1), 4),
               "timings": {k: round(v, 1) for k, v in timings.items()}}
    save_head(head, out, {"method": cfg.method, "steps": steps, "final": final})
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str) + "\n")
    progress(f"wrote the {cfg.method} head to {out}: " + ", ".join(
        f"{s} {r['tokens_per_pass']:.3f}" for s, r in final.items()))
    return metrics


def head_summary(metrics: dict[str, Any]) -> str:
    lines = []
    for s, r in metrics.get("final", {}).items():
        pos = " ".join(f"{x:.2f}" if x is not None else "-" for x in r["accept_by_position"])
        cats = " ".join(f"{c}={v:.2f}" for c, v in r["by_category"].items())
        lines.append(f"{metrics['method']:6s} {s:16s} tok/pass {r['tokens_per_pass']:.3f}  by-pos [{pos}]  {cats}")
    return "\n".join(lines) or f"{metrics.get('method')}: no evaluation sets"


