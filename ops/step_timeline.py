"""Where a captured decode step's GPU time goes, kernel by kernel (e.g. a TP=2 step against TP=1's).

    from ops.step_timeline import profile_replays, format_table
    rows = profile_replays(graph.replay, reps=10, n_layers=32)   # torch.profiler over the replays
    print(format_table(rows))

`python -m ops.tp_bench --timeline 10` runs it on every rank of each size at batch 1, T = 1 (rank 0's kernels are
reported).

Under programmatic dependent launch a kernel starts while the one before it is still running and waits inside
(its recorded duration includes the wait), so summing durations counts the same time twice. Each kernel is
charged its *exposed* time instead: how far its end moves the latest end seen so far, kernels taken in start
order. A step's exposed times add up to its span from the first kernel's start to the last kernel's end.

The step's kernels are grouped by their place in the repeating layer (`layer_pattern`): the kernels before the
first layer ("pre"), position j of every layer ("layer j": summed over the layers, and per layer), and those after
the last ("post"). A kernel is named by its function and grid size, so the output and down projections (one
function, maybe one grid) stay apart by position.

The profiler (CUPTI) may itself slow kernels a little and move their overlap; compare timelines with each other,
not with the unprofiled step times.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence


@dataclass(frozen=True)
class Kernel:
    name: str
    grid: int  # programs (grid x * y * z)
    start_us: float
    dur_us: float

    @property
    def key(self) -> str:
        return f"{short_name(self.name)} [{self.grid}]"

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


def short_name(name: str, width: int = 40) -> str:
    """A kernel's function name without template arguments or parameters, cut to `width` characters."""
    base = name.split("(")[0].split("<")[0].strip()
    base = base.split(" ")[-1] or name
    return base[:width]


def kernels_of_trace(trace: dict) -> list[Kernel]:
    """The GPU kernels of a Chrome trace (torch.profiler's `export_chrome_trace`), in start order."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("cat") != "kernel" or "dur" not in e:
            continue
        grid = e.get("args", {}).get("grid", [1, 1, 1])
        n = 1
        for g in grid:
            n *= int(g)
        out.append(Kernel(str(e.get("name", "?")), n, float(e["ts"]), float(e["dur"])))
    return sorted(out, key=lambda k: k.start_us)


def split_steps(kernels: Sequence[Kernel], steps: int) -> list[list[Kernel]]:
    """`steps` replays of one graph: the same kernel count each, back to back."""
    if steps < 1 or len(kernels) % steps:
        raise ValueError(f"{len(kernels)} kernels do not split into {steps} equal steps")
    n = len(kernels) // steps
    return [list(kernels[i * n:(i + 1) * n]) for i in range(steps)]


def exposed_us(step: Sequence[Kernel]) -> list[float]:
    """Each kernel's exposed time (see the module doc); they add up to the step's span."""
    out, latest = [], None
    for k in step:
        if latest is None:
            out.append(k.dur_us)
            latest = k.end_us
        else:
            out.append(max(0.0, k.end_us - latest))
            latest = max(latest, k.end_us)
    return out


def layer_pattern(keys: Sequence[str], n_layers: int) -> tuple[int, int] | None:
    """(first, period): the smallest period such that `n_layers` repeats of `keys[first:first + period]` follow one
    another from `first` (the earliest such start); None if there is none."""
    n = len(keys)
    for period in range(1, n // max(n_layers, 1) + 1):
        for first in range(0, n - period * n_layers + 1):
            block = keys[first:first + period]
            if all(keys[first + i * period:first + (i + 1) * period] == block for i in range(1, n_layers)):
                return first, period
    return None


def summarize(steps: Sequence[Sequence[Kernel]], n_layers: int) -> list[dict]:
    """One row per place in the step (pre kernels, each layer position, post kernels): the kernel, launches a
    step, busy and exposed microseconds a step (mean over the steps), and per layer for layer positions."""
    keys = [k.key for k in steps[0]]
    pattern = layer_pattern(keys, n_layers) if n_layers > 0 else None
    first, period = pattern if pattern else (len(keys), 0)
    end = first + period * n_layers

    def place(i: int) -> str:
        if i < first:
            return f"pre {i}"
        if i < end:
            return f"layer {(i - first) % period}"
        return f"post {i - end}"

    rows: dict[str, dict] = {}
    for step in steps:
        for i, (k, exp) in enumerate(zip(step, exposed_us(step))):
            r = rows.setdefault(place(i), {"place": place(i), "kernel": k.key, "launches": 0, "busy_us": 0.0,
                                           "exposed_us": 0.0})
            r["launches"] += 1
            r["busy_us"] += k.dur_us
            r["exposed_us"] += exp
    for r in rows.values():
        for f in ("launches", "busy_us", "exposed_us"):
            r[f] /= len(steps)
        if r["place"].startswith("layer"):
            r["exposed_per_layer_us"] = r["exposed_us"] / n_layers
            r["busy_per_layer_us"] = r["busy_us"] / n_layers
    spans = [s[-1].end_us - s[0].start_us for s in steps if s]
    total = {"place": "step", "kernel": f"{len(keys)} kernels, {n_layers if pattern else 0} layers of {period}",
             "launches": len(keys), "busy_us": sum(r["busy_us"] for r in rows.values()),
             "exposed_us": statistics.mean(spans) if spans else 0.0}
    return list(rows.values()) + [total]


def format_table(rows: Sequence[dict]) -> str:
    lines = ["| place | kernel | launches | busy us | exposed us | busy / layer | exposed / layer |",
             "|---|---|---|---|---|---|---|"]
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['place']} | {r['kernel']} | {r['launches']:.0f} | {f(r['busy_us'])} | "
                     f"{f(r['exposed_us'])} | {f(r.get('busy_per_layer_us'))} | {f(r.get('exposed_per_layer_us'))} |")
    return "\n".join(lines)


def profile_replays(replay: Callable[[], object], reps: int, n_layers: int) -> list[dict]:
    """`summarize` of `reps` calls of `replay` (one captured step each) under torch.profiler (CUDA only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with warnings.catch_warnings():  # "Profiler clears events at the end of each cycle": there is one cycle
        warnings.filterwarnings("ignore", message=".*clears events.*")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                replay()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    kernels = kernels_of_trace(trace)
    if not kernels:
        raise RuntimeError("the profiler recorded no kernels of the replays")
    return summarize(split_steps(kernels, reps), n_layers)
