"""The learning curve of the GPU runs: accepted tokens per target pass (K=4, greedy, teacher-forced) against
answer tokens trained on, per drafter depth and data size. Reads ops/distill/runs/*/metrics.json.

    python -m ops.distill.curve [--png ops/distill/runs/curve.png]

Run 3 continues run 2's drafter: its x axis is shifted by run 2's tokens. Run 4 is the clean retrain (from the
target, decontaminated prompts, 11M answer tokens from the runner backend): the shipped drafter.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RUNS = Path(__file__).resolve().parent / "runs"
ORDER = [("run1-variants", None), ("run2-L2", None), ("run3-L2-continued", "run2-L2"), ("run4-clean", None)]


def load() -> list[dict]:
    rows = []
    seen_end: dict[str, int] = {}
    for name, parent in ORDER:
        m = json.loads((RUNS / name / "metrics.json").read_text())
        offset = seen_end.get(parent, 0) if parent else 0
        data = m["data"]["answer_tokens"]
        for h in m["history"]:
            for variant, ev in h["eval"].items():
                rows.append({"run": name, "variant": variant, "data_answer_tokens": data,
                             "answer_tokens_seen": offset + h["answer_tokens_seen"], "step": h["step"],
                             "bench": ev["bench_greedy"]["tokens_per_pass"],
                             "heldout": ev["heldout_greedy"]["tokens_per_pass"],
                             "cost": m["cost_ratio"][variant]})
        seen_end[name] = offset + m["history"][-1]["answer_tokens_seen"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--png", default=None)
    args = ap.parse_args()
    rows = load()
    print("| run | drafter (cost/target) | data: answer tokens | answer tokens trained on | Spec-Bench dev "
          "| held-out |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['variant']} ({r['cost']:.3f}) | {r['data_answer_tokens'] / 1e6:.2f}M | "
              f"{r['answer_tokens_seen'] / 1e6:.1f}M | {r['bench']:.3f} | {r['heldout']:.3f} |")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for i, key in enumerate(("bench", "heldout")):
            series: dict[str, list] = {}
            for r in rows:
                label = f"{r['variant']} ({r['data_answer_tokens'] / 1e6:.2f}M data)"
                if r["run"] == "run3-L2-continued":
                    label = f"L2 continued ({r['data_answer_tokens'] / 1e6:.2f}M data)"
                if r["run"] == "run4-clean":
                    label = f"L2 clean retrain ({r['data_answer_tokens'] / 1e6:.2f}M data, shipped)"
                series.setdefault(label, []).append((max(r["answer_tokens_seen"], 1e5), r[key]))
            for label, pts in series.items():
                ax[i].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            ax[i].axhline(2.3, color="gray", linestyle="--", linewidth=1)
            ax[i].set_xscale("log")
            ax[i].set_xlabel("answer tokens trained on")
            ax[i].set_title({"bench": "Spec-Bench dev (greedy, K=4)", "heldout": "held-out training-like prompts"}[key])
        ax[0].set_ylabel("accepted tokens per target pass")
        ax[1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
