"""`specserve distill --method eagle3|medusa`: train a feature head on the target's own answers.

The data, the draft vocabulary and the evaluation references are the ones `run.distill` makes for a draft model;
here the target's teacher-forced pass over each batch gives both the head's input (its hidden states) and the
labels (its next-token distribution, kept as its top k), and the head learns the cross-entropy to them, weighted
as for a draft model. The target is frozen, so that pass is made once per batch and cached for every later epoch
(`head_features.FeatureCache`): from the second epoch on a step is the head's own forward and backward.

Training: AdamW (weight decay on matrices only), linear warmup then a cosine decay over the steps (`steps`) or
over the wall-clock budget (`train_seconds`: the schedule follows elapsed time, so a run that fills its budget
ends at the low learning rate whatever its speed; a finished timed run started again trains another budget, with
its own warmup and cosine, from where it ended), gradient clipping, autocast in `dtype`. The metrics stay on
the device and are read every `log_every` steps. `work/head_checkpoint.pt` (head, optimizer, step, elapsed time,
curves) is written every `ckpt_every` steps and at every evaluation, where the head is also exported with
`metrics.json` and `curves.png`: a run cut short leaves a usable head, and re-running resumes.

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
import math
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from pipeline.distill.config import DistillConfig
from pipeline.distill.evaluate import Acceptance, _batches, _padded
from pipeline.distill.generate import SampleSet
from pipeline.distill.head_features import FeatureCache, HeadBatch, target_features
from pipeline.distill.target import DTYPES, output_weight
from pipeline.distill.train import collate, epoch_batches
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


def head_loss(head: torch.nn.Module, batch: HeadBatch, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy to the target's (top-k) distributions at every depth (EAGLE-3) or head (Medusa)
    -> (loss, stats [2 n]: per depth its loss, then per depth the share of answer positions where the head's argmax
    is the teacher's). Nothing is read back to the host."""
    if isinstance(head, Eagle3Head):
        outs = head.train_forward(_shift(batch.ids, 1), batch.feats, depth)
    else:
        hidden = head.hidden(batch.feats.float())  # [B, T, K, C]
        outs = [head.logits(hidden[..., i, :], i) for i in range(head.num_heads)]
    losses, agrees = [], []
    for d, logits in enumerate(outs):  # index p predicts the token after position p+1+d
        w = _shift(batch.weights, 1 + d)  # [B, T]
        t_idx = _shift(batch.teacher_idx, 1 + d).long()  # [B, T, k]
        t_prob = _shift(batch.teacher_logp, 1 + d).float().exp()
        logits = logits.float()  # [B, T, V']
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        ce = (t_prob * (lse - logits.gather(-1, t_idx))).sum(-1)  # [B, T]
        losses.append((w * ce).sum() / w.sum().clamp(min=1e-6))
        with torch.no_grad():
            ans = (w >= 1.0).float()
            hit = (logits.argmax(-1) == t_idx[..., 0]).float()
            agrees.append((hit * ans).sum() / ans.sum().clamp(min=1.0))
    loss = torch.stack(losses).mean()
    return loss, torch.cat([torch.stack(losses).detach(), torch.stack(agrees)])


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
                out = target.model(input_ids=ids, use_cache=False, output_hidden_states=True)
                if eagle:
                    layers = head.cfg.layers_for(target.config.num_hidden_layers)
                    feats = torch.cat([out.hidden_states[i] for i in layers], -1)
                    preds = [head.token_ids(o.argmax(-1)) for o in head.train_forward(_shift(ids, 1), feats, depth)]
                else:
                    hidden = head.hidden(out.last_hidden_state.float())
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


def lr_at(cfg: DistillConfig, step: int, frac: float) -> float:
    """Linear warmup over `warmup_steps`, then cosine from `lr` to `lr * min_lr_ratio` as `frac` (the share of the
    run done, in steps or in seconds) goes from 0 to 1."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(max(frac, 0.0), 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def cache_budget(cfg: DistillConfig, device: torch.device) -> tuple[float, float]:
    """(bytes of features kept on the training device, bytes kept in host memory)."""
    if cfg.cache_gb is not None:
        dev = cfg.cache_gb * 2**30
    elif device.type == "cuda":
        torch.cuda.empty_cache()  # the generator's KV cache, released but still held by the caching allocator
        free, _ = torch.cuda.mem_get_info(device)
        dev = max(0.0, free - 24 * 2**30)  # the step's activations (logits over the draft vocabulary per depth)
    else:
        dev = 8 * 2**30
    return dev, (cfg.host_cache_gb * 2**30 if device.type == "cuda" else 0.0)


def train_head(cfg: DistillConfig, target: Any, data: SampleSet, token_ids: torch.Tensor | None,
               eval_sets: dict[str, tuple[SampleSet, float]], work: Path, device: torch.device,
               progress: Callable[[str], None] = print, on_eval: Callable[[torch.nn.Module, dict], None] | None = None,
               stop_at: int | None = None) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Train (resumable from work/head_checkpoint.pt) -> (head, state: step, elapsed, history, log, cache).

    `on_eval(head, state)` runs after every evaluation (the run exports the head there); `stop_at` ends this call
    after that many steps in all, as an interruption would (the checkpoint is written)."""
    from tqdm.auto import tqdm

    torch.manual_seed(cfg.seed)
    head = build_head(cfg, target, token_ids).to(device)
    named = [(n, p) for n, p in head.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    groups = [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    rows = None if token_ids is None else token_ids.to(device)
    ac_dtype = DTYPES[cfg.dtype] if cfg.dtype != "float32" else None

    def autocast():
        return torch.autocast(device.type, dtype=ac_dtype) if ac_dtype else nullcontext()

    eagle = isinstance(head, Eagle3Head)
    depth = cfg.head_depth if eagle else head.num_heads
    layers = head.cfg.layers_for(target.config.num_hidden_layers) if eagle else None
    batches = epoch_batches(data.lengths, cfg.batch_tokens, cfg.max_seq_len, cfg.seed)
    answer_tokens = [int((data.lengths[b] - data.prompt_lens[b]).sum()) for b in batches]

    def make(i: int) -> HeadBatch:
        b = collate(data, batches[i], cfg.max_seq_len, cfg.prompt_weight)
        return target_features(target, b.input_ids.to(device), b.weights.to(device), layers, rows, cfg.teacher_topk,
                               autocast())

    cache = FeatureCache(make, device, *cache_budget(cfg, device))
    orders: dict[int, np.ndarray] = {}

    def batch_index(step: int) -> int:  # the batches are fixed; each epoch after the first visits them reshuffled
        epoch, j = divmod(step, len(batches))
        if epoch not in orders:
            orders.clear()
            orders[epoch] = (np.random.default_rng(cfg.seed * 7919 + epoch).permutation(len(batches)) if epoch
                             else np.arange(len(batches)))
        return int(orders[epoch][j])

    ckpt = work / "head_checkpoint.pt"
    # cycle_*: where this time budget's schedule began (a finished timed run, run again, trains another budget)
    state: dict[str, Any] = {"step": 0, "elapsed": 0.0, "answer_tokens": 0, "history": [], "log": [], "done": False,
                             "cycle_step": 0, "cycle_elapsed": 0.0}
    if ckpt.exists():
        saved = torch.load(ckpt, map_location=device, weights_only=False)
        head.load_state_dict(saved["head"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        progress(f"resumed {cfg.method} at step {state['step']} ({state['elapsed']:.0f} s trained)")
        if state["done"] and cfg.train_seconds is not None:  # warm restart: warmup and cosine over the new budget
            state.update(done=False, cycle_step=state["step"], cycle_elapsed=state["elapsed"])
            progress(f"the earlier run had finished: {cfg.train_seconds:.0f} s more, a new schedule")

    def save() -> None:
        work.mkdir(parents=True, exist_ok=True)
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "state": state}, tmp)
        tmp.replace(ckpt)

    t_mark, elapsed0 = time.perf_counter(), state["elapsed"]

    def elapsed() -> float:
        return elapsed0 + time.perf_counter() - t_mark

    def frac(step: int) -> float:
        if cfg.train_seconds is not None:
            return (elapsed() - state["cycle_elapsed"]) / cfg.train_seconds
        return (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)

    def budget_spent(step: int) -> bool:
        if cfg.train_seconds is not None:
            return elapsed() - state["cycle_elapsed"] >= cfg.train_seconds
        return step >= cfg.steps

    def finished(step: int) -> bool:
        return (stop_at is not None and step >= stop_at) or budget_spent(step)

    acc = torch.zeros(2 * depth, device=device)
    n_acc, lr = 0, cfg.lr

    def flush() -> dict[str, float] | None:
        nonlocal acc, n_acc
        if not n_acc:
            return None
        vals = (acc / n_acc).tolist()  # the one host read of the training metrics
        row = {"step": state["step"], "elapsed": round(elapsed(), 2), "lr": lr,
               "loss": round(sum(vals[:depth]) / depth, 4)}
        row.update({f"loss{d}": round(vals[d], 4) for d in range(depth)})
        row.update({f"agree{d}": round(vals[depth + d], 4) for d in range(depth)})
        state["log"].append(row)
        acc, n_acc = torch.zeros_like(acc), 0
        return row

    def evaluate() -> None:
        row = flush()
        ev = evaluate_head(head, target, eval_sets, cfg.eval_k, ac_dtype) if eval_sets else {}
        entry = {"step": state["step"], "elapsed": round(elapsed(), 2), "answer_tokens": state["answer_tokens"],
                 "eval": ev}
        if row is not None:
            entry["train"] = {k: v for k, v in row.items() if k not in ("step", "elapsed")}
        state["history"].append(entry)
        progress(f"{cfg.method} step {state['step']} ({elapsed():.0f} s, {state['answer_tokens']} answer tokens): "
                 + (f"loss {row['loss']:.3f} " if row else "") + ", ".join(
                     f"{s} {r['tokens_per_pass']:.3f}" for s, r in ev.items()) + f"; cache {cache.stats()}")
        save()
        if on_eval is not None:
            on_eval(head, state)

    head.train()
    last_eval = [elapsed()]
    if state["step"] == 0 and eval_sets and not state["history"]:
        evaluate()
    bar = tqdm(total=None if cfg.train_seconds is not None else cfg.steps, initial=state["step"],
               desc=f"distill {cfg.method}", dynamic_ncols=True, mininterval=5.0)
    while not finished(state["step"]):
        step = state["step"]
        lr = lr_at(cfg, step - state["cycle_step"], frac(step))
        for g in opt.param_groups:
            g["lr"] = lr
        i = batch_index(step)
        hb = cache.get(i)
        with autocast():
            loss, stats = head_loss(head, hb, depth)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        acc += stats
        n_acc += 1
        state["step"] = step + 1
        state["answer_tokens"] += answer_tokens[i]
        state["elapsed"] = elapsed()
        bar.update(1)
        last = finished(state["step"])
        if state["step"] % cfg.log_every == 0 and not last:
            row = flush()
            bar.set_postfix({"loss": f"{row['loss']:.3f}", "acc0": f"{row['agree0']:.3f}"}, refresh=False)
        timely = cfg.train_seconds is not None and elapsed() - last_eval[0] >= max(cfg.train_seconds / 8, 20.0)
        if state["step"] % cfg.eval_every == 0 or last or timely:  # with a time budget: a point every 1/8 of it
            evaluate()
            last_eval[0] = elapsed()
        elif state["step"] % cfg.ckpt_every == 0:
            save()
    bar.close()
    state["elapsed"] = elapsed()
    state["done"] = budget_spent(state["step"])
    state["cache"] = cache.stats()
    save()
    return head, state


def plot_curves(metrics: dict[str, Any], path: Path) -> bool:
    """Training loss and held-out tokens per pass against steps (one PNG); False where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    log, hist = metrics.get("train_log") or [], metrics.get("history") or []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if log:
        ax1.plot([r["step"] for r in log], [r["loss"] for r in log], label="loss (mean over depths)")
        depth = sum(1 for k in log[-1] if k.startswith("agree"))
        ax1b = ax1.twinx()
        for d in range(depth):
            ax1b.plot([r["step"] for r in log], [r[f"agree{d}"] for r in log], lw=0.8, ls="--",
                      label=f"top-1 agreement, depth {d}")
        ax1b.set_ylabel("top-1 agreement with the target (answer positions)")
        ax1b.legend(loc="center right", fontsize=7)
        ax1.legend(loc="upper right", fontsize=7)
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss")
    sets = sorted({s for h in hist for s in h.get("eval", {})})
    for s in sets:
        pts = [(h["step"], h["eval"][s]["tokens_per_pass"]) for h in hist if s in h.get("eval", {})]
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
    ax2.set_xlabel("step")
    ax2.set_ylabel(f"tokens per target pass (greedy, K={metrics.get('eval_k', 4)})")
    ax2.grid(alpha=0.3)
    if sets:
        ax2.legend(fontsize=7)
    fig.suptitle(metrics.get("title", metrics.get("method", "")), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def run_heads(cfg: DistillConfig, target: Any, data: SampleSet, token_ids: torch.Tensor | None,
              eval_sets: dict[str, tuple[SampleSet, float]], out: Path, meta: dict, timings: dict,
              progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Train, evaluate and export the head to `out` (+ metrics.json, curves.png), exporting at every evaluation."""
    device = next(target.parameters()).device
    t_target = sum(p.numel() for n, p in target.named_parameters() if "embed" not in n)
    t0 = time.perf_counter()

    def metrics_of(head: torch.nn.Module, state: dict, final: dict) -> dict[str, Any]:
        n_params = sum(p.numel() for p in head.parameters() if p.requires_grad)
        return {**meta, "method": cfg.method, "final": final, "history": state["history"], "train_log": state["log"],
                "steps": state["step"], "train_elapsed_s": round(state["elapsed"], 1),
                "answer_tokens_trained": state["answer_tokens"], "epochs": round(
                    state["answer_tokens"] / max(data.response_tokens, 1), 3), "cache": state.get("cache"),
                "eval_k": cfg.eval_k, "head_params": n_params, "cost_ratio": round(n_params / max(t_target, 1), 4),
                "title": f"{cfg.method}: {data.response_tokens} answer tokens, batch {cfg.batch_tokens} tokens, "
                         f"lr {cfg.lr:g}", "timings": {k: round(v, 1) for k, v in timings.items()}}

    def write(head: torch.nn.Module, state: dict, final: dict) -> dict[str, Any]:
        metrics = metrics_of(head, state, final)
        save_head(head, out, {"method": cfg.method, "steps": state["step"], "final": final})
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str) + "\n")
        try:
            plot_curves(metrics, out / "curves.png")
        except Exception as e:  # noqa: BLE001 - a figure never stops the training
            progress(f"curves.png not written: {e!r}")
        return metrics

    def on_eval(head: torch.nn.Module, state: dict) -> None:  # a usable head and its figures at every evaluation
        write(head, state, state["history"][-1]["eval"] if state["history"] else {})

    head, state = train_head(cfg, target, data, token_ids, eval_sets, out / "work", device, progress, on_eval)
    timings["train_s"] = time.perf_counter() - t0
    ac = DTYPES[cfg.dtype] if cfg.dtype != "float32" else None
    with torch.no_grad():  # the final figures are those of the exported (bfloat16) weights
        for p in head.parameters():
            p.copy_(p.to(EXPORT_DTYPE).to(p.dtype))
    t0 = time.perf_counter()
    final = evaluate_head(head, target, eval_sets, cfg.eval_k, ac) if eval_sets else {}
    timings["final_eval_s"] = time.perf_counter() - t0
    metrics = write(head, state, final)
    progress(f"wrote the {cfg.method} head to {out} ({state['step']} steps, {metrics['epochs']} epochs): " + ", ".join(
        f"{s} {r['tokens_per_pass']:.3f}" for s, r in final.items()))
    return metrics


def head_summary(metrics: dict[str, Any]) -> str:
    lines = []
    for s, r in metrics.get("final", {}).items():
        pos = " ".join(f"{x:.2f}" if x is not None else "-" for x in r["accept_by_position"])
        cats = " ".join(f"{c}={v:.2f}" for c, v in r["by_category"].items())
        lines.append(f"{metrics['method']:6s} {s:16s} tok/pass {r['tokens_per_pass']:.3f}  by-pos [{pos}]  {cats}")
    return "\n".join(lines) or f"{metrics.get('method')}: no evaluation sets"


