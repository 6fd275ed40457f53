"""The learning curve of distillation runs: accepted tokens per target pass (K=4, greedy, teacher-forced) against
answer tokens trained on, per drafter depth and data size.

    python -m ops.distill.curve --runs out/distill-runs [--png out/distill-runs/curve.png]

Reads `RUNS/NAME/metrics.json` (the file `specserve distill` writes into its output folder) for each run NAME in
`ORDER`. The run folders are not part of the repository: put them under the folder given by `--runs` (default
`out/distill-runs`, which git ignores). A run that continued another run's drafter names that run as its parent
in `ORDER`; its x axis is shifted by the parent's tokens. run4-clean (from the target, decontaminated prompts,
11M answer tokens from the runner backend) is the run that produced the shipped drafter.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_RUNS = Path("out/distill-runs")
ORDER = [("run1-variants", None), ("run2-L2", None), ("run3-L2-continued", "run2-L2"), ("run4-clean", None)]


def load(runs: Path) -> list[dict]:
    rows = []
    seen_end: dict[str, int] = {}
    for name, parent in ORDER:
        path = runs / name / "metrics.json"
        if not path.is_file():
            raise SystemExit(f"{path}: no such file (--runs is the folder that holds one folder per run of ORDER)")
        m = json.loads(path.read_text())
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, default=DEFAULT_RUNS,
                    help="folder with one folder per run, each holding its metrics.json (default: %(default)s)")
    ap.add_argument("--png", default=None, help="also plot the curve into this PNG file")
    args = ap.parse_args()
    rows = load(args.runs)
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
