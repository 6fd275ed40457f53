"""The best static token tree for a drafter, a target and a machine (Sequoia, Chen et al. 2024, section 3.1).

Acceptance model. `rank_acceptance[d][r]` is the probability that, on the accepted path at depth d (d = 0: the
pending token's children), the target's token is the drafter's rank-r candidate (rank 0: its favourite), given
that the path got there; measured from greedy decoding (the rank of the target's token among the drafter's
candidates drafted from the accepted path; "none" when it is not among them). Assuming that probability depends on
the depth and the rank alone, a tree's expected accepted drafts per pass are the sum over its nodes of the product
of `rank_acceptance` along the node's rank path (`expected_accepted`). A tree is a set of rank paths closed under
parents whose children of each node are a run of ranks 0..c-1 (`pipeline.config.TreeConfig.paths`).

Optimiser (`best_trees`). Sequoia's dynamic program: for every node budget n <= N and depth bound D' <= D, the tree
of n nodes and depth <= D' with the most expected accepted drafts. best(d, r, n), the best value of n nodes spent
on the children of ranks r, r+1, .. of one node whose children sit at depth d, is the best over m (the nodes of the
rank-r child's subtree) of acc[d][r] * (1 + best(d + 1, 0, m - 1)) + best(d, r + 1, n - m): the children stay a run
of ranks and every subtree is optimal on its own, so the program is exact for any `rank_acceptance`. Where every
acc[d] falls with the rank, a node's value never exceeds its parent's nor its left sibling's, so the n paths of
highest value (within the depth bound) form a valid tree and greedy selection would give the same value; measured
vectors need not be monotone (noise, a drafter whose second guess beats its first at some depth), which is why the
program is used. The depth bound matters because drafting costs one draft step per level.

Hardware-aware choice (`choose`): over every (n, D') the tree maximising predicted tokens per second,
(1 + E[accepted]) / (verify_s(n + 1) + depth * draft_level_s), from a measured cost table (`Costs`: the target's
verify pass over n + 1 tokens with the tree mask, one draft level). The tree file (`save_tree`, `load_tree`) holds
the chosen tree as rank paths with its parents and ranks, the inputs it was computed from and the prediction.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

from pipeline.config import MAX_TREE_NODES, TreeConfig

TREE_FORMAT = "specserve-tree/1"
RankAcceptance = Sequence[Sequence[float]]  # [D][R]: rank_acceptance[d][r] (module docstring)


def expected_accepted(paths: Sequence[tuple[int, ...]], rank_acceptance: RankAcceptance) -> float:
    """Expected accepted drafts per pass of the tree of `paths` (module docstring); ranks or depths beyond the
    measured ones count 0."""
    total = 0.0
    for path in paths:
        value = 1.0
        for d, r in enumerate(path):
            value *= _acc(rank_acceptance, d, r)
        total += value
    return total


def _acc(rank_acceptance: RankAcceptance, d: int, r: int) -> float:
    return float(rank_acceptance[d][r]) if d < len(rank_acceptance) and r < len(rank_acceptance[d]) else 0.0


def acceptance_from_counts(hits: Sequence[Sequence[int]], exposures: Sequence[Sequence[int]]) -> list[list[float]]:
    """rank_acceptance[d][r] = hits[d][r] / exposures[d][r]: of the passes whose accepted path reached depth d with
    a rank-r candidate drafted there (exposures), those whose target token was that candidate (hits). Unexposed
    ranks get 0; a depth whose estimates add up past 1 (noise) is scaled to 1."""
    out = []
    for h_d, e_d in zip(hits, exposures):
        row = [h / e if e else 0.0 for h, e in zip(h_d, e_d)]
        total = sum(row)
        out.append([a / total for a in row] if total > 1.0 else row)
    return out


class RankCounter:
    """hits and exposures for `acceptance_from_counts`, from greedy passes over drafted trees (or chains)."""

    def __init__(self, depth: int, ranks: int) -> None:
        self.hits = [[0] * ranks for _ in range(depth)]
        self.exposures = [[0] * ranks for _ in range(depth)]

    def observe(self, parents: Sequence[int], tokens: Sequence[int], truth: Sequence[int]) -> None:
        """One pass: the drafted nodes (each one's parent, -1: the pending token; siblings in rank order) and
        their tokens, and the target's greedy tokens after the pending token (truth[d] at depth d, as many as are
        known). Walks the accepted path: at each depth every drafted child of the path's node is exposed, and the
        one holding the target's token is hit."""
        node, depth, ranks = -1, len(self.hits), len(self.hits[0]) if self.hits else 0
        for d in range(min(depth, len(truth))):
            children = [i for i, p in enumerate(parents) if p == node]  # in rank order
            match = None
            for rank, i in enumerate(children[:ranks]):
                self.exposures[d][rank] += 1
                if tokens[i] == truth[d]:
                    self.hits[d][rank] += 1
                    match = i
            if match is None:
                return
            node = match

    def rank_acceptance(self) -> list[list[float]]:
        return acceptance_from_counts(self.hits, self.exposures)


@dataclass(frozen=True)
class TunedTree:
    """A tree of the optimiser: its rank paths (breadth first) and expected accepted drafts per pass."""

    paths: tuple[tuple[int, ...], ...]
    accepted: float

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)


def best_trees(rank_acceptance: RankAcceptance, max_nodes: int, max_depth: int) -> dict[tuple[int, int], TunedTree]:
    """(n, D') -> the tree of n nodes and depth <= D' with the most expected accepted drafts, for n in 1..max_nodes
    and D' in 1..max_depth (module docstring: Sequoia's dynamic program); pairs no tree fits are left out (more
    nodes than ranks ** depth allow)."""
    if not 1 <= max_nodes <= MAX_TREE_NODES or max_depth < 1:
        raise ValueError(f"max_nodes must be in [1, {MAX_TREE_NODES}] and max_depth >= 1, got {max_nodes}, "
                         f"{max_depth}")
    ranks = max((len(row) for row in rank_acceptance), default=0)
    if ranks == 0:
        raise ValueError("rank_acceptance is empty")
    out: dict[tuple[int, int], TunedTree] = {}
    for bound in range(1, max_depth + 1):
        best = _program(rank_acceptance, ranks, bound)
        for n in range(1, max_nodes + 1):
            value, _ = best(0, 0, n)
            if value == float("-inf"):
                continue
            paths = tuple(sorted(_paths(best, 0, 0, n, ()), key=lambda p: (len(p), p)))
            out[(n, bound)] = TunedTree(paths, value)
    return out


def _program(rank_acceptance: RankAcceptance, ranks: int, bound: int):
    """best(d, r, n) -> (value, m): n nodes spent on the children of ranks >= r at depth d, m of them under the
    rank-r child (0: none)."""

    @lru_cache(maxsize=None)
    def best(d: int, r: int, n: int) -> tuple[float, int]:
        if n == 0:
            return 0.0, 0
        if d >= bound or r >= ranks:
            return float("-inf"), 0
        acc = _acc(rank_acceptance, d, r)
        top, arg = float("-inf"), 0
        for m in range(1, n + 1):  # the rank-r child's subtree holds m nodes
            below, rest = best(d + 1, 0, m - 1)[0], best(d, r + 1, n - m)[0]
            if below == float("-inf") or rest == float("-inf"):
                continue
            value = acc * (1.0 + below) + rest
            if value > top + 1e-12:  # ties: the smaller subtree first (a shallower, wider tree)
                top, arg = value, m
        return top, arg

    return best


def _paths(best, d: int, r: int, n: int, prefix: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    while n > 0:
        m = best(d, r, n)[1]
        node = prefix + (r,)
        out += [node] + _paths(best, d + 1, 0, m - 1, node)
        n, r = n - m, r + 1
    return out


@dataclass(frozen=True)
class Costs:
    """Seconds of one step's parts on a machine: the target's verify pass over T tokens (the pending token and a
    tree of T - 1 nodes, with the tree mask) and one level of drafting."""

    device: str  # the machine, in words
    verify_s: dict[int, float]  # T -> seconds
    draft_level_s: float

    def step_s(self, nodes: int, depth: int) -> float:
        return self.verify_s[nodes + 1] + depth * self.draft_level_s

    def as_json(self) -> dict[str, Any]:
        return {"device": self.device, "verify_s": {str(t): s for t, s in sorted(self.verify_s.items())},
                "draft_level_s": self.draft_level_s}

    @staticmethod
    def from_json(obj: dict[str, Any]) -> "Costs":
        """{"device": str, "verify_s": {"2": s, "3": s, ...}, "draft_level_s": s}; ValueError when malformed."""
        try:
            verify = {int(t): float(s) for t, s in obj["verify_s"].items()}
            costs = Costs(str(obj.get("device", "unknown")), verify, float(obj["draft_level_s"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f'a cost table is {{"device": ..., "verify_s": {{"2": s, ...}}, "draft_level_s": s}}; '
                             f"{type(e).__name__}: {e}") from None
        if not verify or min(verify) < 2 or min(verify.values()) <= 0 or costs.draft_level_s < 0:
            raise ValueError("a cost table needs verify_s for T >= 2 tokens (seconds > 0) and draft_level_s >= 0")
        return costs


@dataclass(frozen=True)
class Choice:
    """A tree with its predicted speed on a machine."""

    tree: TunedTree
    step_s: float  # predicted seconds of one step (verify + drafting)

    @property
    def tokens_per_pass(self) -> float:
        return 1.0 + self.tree.accepted

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_pass / self.step_s


def choose(trees: dict[tuple[int, int], TunedTree], costs: Costs) -> tuple[Choice, list[Choice]]:
    """(the tree of most predicted tokens per second, the best one per node budget, by budget) over `trees`'
    (n, D') whose n + 1 tokens the cost table times."""
    per_budget: dict[int, Choice] = {}
    for (n, _), tree in sorted(trees.items()):
        if n + 1 not in costs.verify_s:
            continue
        c = Choice(tree, costs.step_s(n, tree.depth))
        if n not in per_budget or c.tokens_per_s > per_budget[n].tokens_per_s:
            per_budget[n] = c
    if not per_budget:
        raise ValueError(f"the cost table ({costs.device}) times none of the trees' sizes: verify_s has T = "
                         f"{sorted(costs.verify_s)}, the trees need n + 1 for n = 1..{max(n for n, _ in trees)}")
    rows = [per_budget[n] for n in sorted(per_budget)]
    return max(rows, key=lambda c: c.tokens_per_s), rows


def verify_seconds(target: Any, passes: dict[str, int | Any], context: int, reps: int,
                   reduce: Callable[[list[float]], float] = statistics.median) -> dict[str, float]:
    """Seconds (`reduce` of the timed passes: their median, or their least) of one verify pass of `target` (a
    fast-path runner) at a `context`-token context: for each name a chain of T tokens (an int) or the pending token
    and a `pipeline.tree.TreeShape`'s nodes with its tree mask; the passes run interleaved, `reps` timed times each
    after one untimed round. Re-allocates the target's cache (one slot)."""
    import torch

    from pipeline.models.tree_attention import TreeMask

    calls: dict[str, tuple[int, TreeMask | None]] = {}
    for name, p in passes.items():
        if isinstance(p, int):
            calls[name] = (p, None)
        else:
            parents = torch.tensor([[-1] + [q + 1 for q in p.parents]],  # [1, n + 1]: the pending token first
                                   device=getattr(target, "device", "cpu"))
            calls[name] = (p.num_nodes + 1, TreeMask(parents))
    target.allocate(1, context + max(t for t, _ in calls.values()) + 16)
    target.forward(torch.randint(100, 5000, (1, context)), torch.tensor([0]), torch.tensor([0]), context - 1)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for rep in range(reps + 1):  # the first round warms up, untimed
        for name, (T, tree) in calls.items():
            tokens = torch.randint(100, 5000, (1, T))  # [1, T]
            t0 = time.perf_counter()
            logits = target.forward(tokens, torch.tensor([context]), torch.tensor([0]), tree=tree)
            float(logits[0, -1, 0])  # the pass is done (a device sync)
            if rep:
                times[name].append(time.perf_counter() - t0)
    return {name: reduce(ts) for name, ts in times.items()}


def save_tree(path: str | Path, choice: Choice, table: list[Choice], rank_acceptance: RankAcceptance, costs: Costs,
              about: dict[str, Any]) -> None:
    """Write the tree file: the chosen tree (rank paths, parents, ranks), its prediction, the best tree per budget
    and the inputs (`rank_acceptance`, the cost table, `about`: drafter, target, prompts, date)."""
    from pipeline.tree import tree_shape

    shape = tree_shape(TreeConfig(paths=choice.tree.paths))
    obj = {
        "format": TREE_FORMAT,
        "paths": [list(p) for p in choice.tree.paths],
        "parents": list(shape.parents),
        "ranks": list(shape.ranks),
        "predicted": {"nodes": choice.tree.num_nodes, "depth": choice.tree.depth,
                      "tokens_per_pass": choice.tokens_per_pass, "step_s": choice.step_s,
                      "tokens_per_s": choice.tokens_per_s},
        "table": [{"nodes": c.tree.num_nodes, "depth": c.tree.depth, "tokens_per_pass": c.tokens_per_pass,
                   "step_s": c.step_s, "tokens_per_s": c.tokens_per_s, "paths": [list(p) for p in c.tree.paths]}
                  for c in table],
        "inputs": {"rank_acceptance": [list(map(float, row)) for row in rank_acceptance], "costs": costs.as_json(),
                   **about},
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")


def read_json(path: str | Path, what: str) -> dict[str, Any]:
    """A JSON object from a file; FileNotFoundError / ValueError with one line naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        obj = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} {path} is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{what} {path} holds no JSON object")
    return obj


def load_tree(path: str | Path) -> TreeConfig:
    """The `TreeConfig` of a tree file's shape (`save_tree`); one-line errors for a missing or bad file."""
    obj = read_json(path, "tree file")
    paths = obj.get("paths")
    if obj.get("format") != TREE_FORMAT or not isinstance(paths, list):
        raise ValueError(f"{path} is not a tree file of `specserve tune-tree` (format {TREE_FORMAT!r} with paths)")
    try:
        return TreeConfig(paths=tuple(tuple(p) for p in paths))
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad tree file {path}: {e}") from None


def load_rank_acceptance(path: str | Path) -> list[list[float]]:
    """`rank_acceptance` from a JSON file: a tree file (its inputs) or {"rank_acceptance": [[...], ...]}."""
    obj = read_json(path, "acceptance file")
    value = obj.get("rank_acceptance", obj.get("inputs", {}).get("rank_acceptance"))
    try:
        rows = [[float(a) for a in row] for row in value]
    except TypeError:
        rows = []
    if not rows or not all(rows) or any(not 0.0 <= a <= 1.0 for row in rows for a in row) \
            or any(sum(row) > 1.0 + 1e-6 for row in rows):
        raise ValueError(f"{path}: rank_acceptance must be a list per depth of probabilities per rank (each in "
                         "[0, 1], adding up to at most 1)")
    return rows


def load_costs(path: str | Path) -> Costs:
    """A cost table from a JSON file: {"device", "verify_s", "draft_level_s"}, or a tree file (its inputs)."""
    obj = read_json(path, "cost table")
    if "verify_s" not in obj and isinstance(obj.get("inputs"), dict):
        obj = obj["inputs"].get("costs", obj)
    try:
        return Costs.from_json(obj)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def parse_tree(text: str) -> TreeConfig:
    """A tree word of the tree benchmarks (`ops/bench_tree.py`, `ops/head_acceptance.py --trees`): '3,2,2,1:8' ->
    TreeConfig((3, 2, 2, 1), max_nodes=8); 'dyn:4,4,4,4:12' -> the same, dynamic=True; a path to a `specserve
    tune-tree` file (FILE.json) -> its shape."""
    if text.endswith(".json"):
        return load_tree(text)
    dynamic = text.startswith("dyn:")
    branching, _, nodes = text.removeprefix("dyn:").partition(":")
    try:
        return TreeConfig(tuple(int(b) for b in branching.split(",")), int(nodes) if nodes else None,
                          dynamic=dynamic)
    except ValueError as e:
        raise ValueError(f"bad tree {text!r}: BRANCHING[:MAX_NODES], dyn:BRANCHING:MAX_NODES or FILE.json ({e})")


def tree_name(t: TreeConfig) -> str:
    """A tree's name in a table: its file's shape, a dynamic or static branching and budget."""
    if t.paths is not None:
        return f"tuned tree ({len(t.paths)} nodes, depth {len(t.branching)})"
    return (f"{'dynamic ' if t.dynamic else ''}tree {','.join(map(str, t.branching))}"
            + (f" budget {t.max_nodes}" if t.max_nodes else ""))
