"""Token trees: the shape, the tree attention mask against chains, the tree walk on literal tables, statistical
exactness of multi-draft rejection sampling with siblings (with negative controls that must fail), and the engine's
greedy output with trees equal to the target's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy.stats import chisquare

from pipeline.config import EngineConfig, SamplingParams, SpecParams, TreeConfig
from pipeline.drafters import ModelDrafter
from pipeline.engine import SpeculativeEngine
from pipeline.models.graphs import GraphCausalLM, GraphConfig
from pipeline.models.loader import load_model
from pipeline.models.tree_attention import TreeMask, compact_indices, tree_ancestors, tree_bits, tree_depths
from pipeline.rejection import DraftBlock, VerifyOutput, accept, verify
from pipeline.rng import Stream, uniform
from pipeline.sampling import SamplingTensors, sample_from_probs, warp
from pipeline.tree import TreeShape, draw_without_replacement, tree_shape
from tests.support.models import NoTreeRunner

V = 8


# ---- shape -----------------------------------------------------------------------------------------------------


def test_shape_is_breadth_first_and_the_budget_keeps_the_likeliest_paths():
    full = tree_shape(TreeConfig((2, 2)))
    assert full.parents == (-1, -1, 0, 0, 1, 1) and full.ranks == (0, 1, 0, 1, 0, 1) and full.depth == 2
    cut = tree_shape(TreeConfig((3, 2, 1), max_nodes=6))
    # by rank sum, then depth: (0) (0,0) (0,0,0) | (1) (0,1) (1,0) | (2) ... keeps the first six, parents first
    assert cut.parents == (-1, -1, 0, 0, 1, 2) and cut.ranks == (0, 1, 0, 1, 0, 0)
    assert cut.nodes_within(1) == 2 and cut.nodes_within(2) == 5 and cut.depth == 3
    assert TreeShape.chain(3) == tree_shape(TreeConfig((1, 1, 1)))
    with pytest.raises(ValueError, match="at most 64"):
        TreeConfig((8, 8, 8))
    with pytest.raises(ValueError, match="branching"):
        TreeConfig((2, 0))


def test_depths_and_ancestors():
    parents = torch.tensor([[-1, -1, 0, 0, 2]])
    assert tree_depths(parents).tolist() == [[0, 0, 1, 1, 2]]
    anc = tree_ancestors(parents)[0].int().tolist()
    assert anc[4] == [1, 0, 1, 0, 1] and anc[1] == [0, 1, 0, 0, 0]
    src, dst = compact_indices(torch.tensor([10]), torch.tensor([[0, 2, 4, -1, -1]]))
    assert src.tolist() == [[10, 12, 14, 13, 14]] and dst.tolist() == [[10, 11, 12, 13, 14]]


# ---- the tree mask against chains --------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["eager", "static"])
def target(tiny_models, request):
    """The tiny target on the eager runner and on the static-shape graph path (uncaptured, SDPA attention: the
    same tree attention and `compact` as the CUDA graphs', tests/gpu has those)."""
    model = load_model(tiny_models["llama"])[0]
    if request.param == "static":
        model = GraphCausalLM(model, GraphConfig(graphs=False, compile=False, attention="sdpa", linear="torch"))
    return model


@pytest.mark.parametrize("nodes", [1, 2, 7, 25, 63])
def test_tree_bits_are_the_ancestor_sets_and_depths(nodes):
    """Pointer jumping (the bit sets of the graph path, the ancestor matrix and depths of the eager path) against
    each node's ancestors walked up one parent at a time, on random trees."""
    g = torch.Generator().manual_seed(nodes)
    for _ in range(10):
        parents = torch.tensor([[-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, nodes)]
                                for _ in range(3)])
        anc = torch.zeros(3, nodes, nodes, dtype=torch.bool)  # walked up node by node
        for b in range(3):
            for i in range(nodes):
                j = i
                while j >= 0:
                    anc[b, i, j] = True
                    j = int(parents[b, j])
        bits, depth = tree_bits(parents)
        assert torch.equal(bits, (anc.long() << torch.arange(nodes)).sum(-1))
        assert torch.equal(depth, anc.sum(-1) - 1)
        assert torch.equal(tree_ancestors(parents), anc) and torch.equal(tree_depths(parents), depth)


def test_tree_forward_equals_each_paths_chain_forward_and_compaction_keeps_the_path(target):
    """A node's logits from one tree pass equal those of its root-to-node path fed as a chain; after `compact`, the
    cache holds the accepted path as a chain pass would have written it."""
    target.allocate(3, 64)
    prompt = torch.tensor([[5, 17, 33, 9, 41]])
    for slot in range(3):
        target.forward(prompt, torch.tensor([0]), torch.tensor([slot]))
    pending, nodes = 7, [11, 12, 13, 14, 15, 16]
    parents = [-1, -1, 0, 0, 1, 3]  # fed parents: pending at 0, node i at i + 1
    fed = torch.tensor([[pending] + nodes])
    fed_parents = torch.tensor([[-1] + [p + 1 for p in parents]])
    start = torch.tensor([5])
    tree_logits = target.forward(fed, start, torch.tensor([0]), tree=TreeMask(fed_parents))[0]  # [7, V]
    for i in range(len(nodes)):
        path, j = [], i
        while j >= 0:
            path.insert(0, nodes[j])
            j = parents[j]
        chain = target.forward(torch.tensor([[pending] + path]), start, torch.tensor([1]))[0]
        torch.testing.assert_close(tree_logits[i + 1], chain[-1], rtol=1e-4, atol=1e-4)
    # accept nodes 0 -> 3 -> 5 (tokens 11, 14, 16): move them to positions 6, 7, 8 of slot 0
    src, dst = compact_indices(start + 1, torch.tensor([[0, 3, 5, -1, -1, -1]]))
    target.compact(torch.tensor([0]), src, dst)
    nxt = torch.tensor([[21, 22]])
    after_tree = target.forward(nxt, torch.tensor([9]), torch.tensor([0]))
    target.forward(torch.tensor([[pending, 11, 14, 16]]), start, torch.tensor([2]))
    after_chain = target.forward(nxt, torch.tensor([9]), torch.tensor([2]))
    torch.testing.assert_close(after_tree, after_chain, rtol=1e-4, atol=1e-4)


# ---- greedy walk: literal tables ----------------------------------------------------------------------------------

# tree: node 0 (tok 1) and node 1 (tok 2) under pending; node 2 (tok 3) and node 3 (tok 4) under node 0;
# node 4 (tok 5) under node 1. Argmaxes per fed position [pending, n0..n4] -> emitted.
PARENTS = [-1, -1, 0, 0, 1]
TOKENS = [1, 2, 3, 4, 5]
GREEDY_TREE_TABLE = [
    ([1, 4, 0, 0, 0, 0], 5, [1, 4, 0]),  # first child, then its second child, then the bonus at node 3
    ([2, 0, 5, 0, 0, 6], 5, [2, 5, 6]),  # the second child, its child, bonus
    ([1, 7, 0, 0, 0, 0], 5, [1, 7]),  # first child, then no child matches: recovered 7
    ([6, 0, 0, 0, 0, 0], 5, [6]),  # no child of pending matches
    ([2, 0, 5, 0, 0, 6], 2, [2, 5]),  # only nodes 0, 1 drafted: the bonus at node 1
    ([1, 3, 0, 7, 0, 0], 5, [1, 3, 7]),  # first child, its first child, then the bonus at node 2
]


@pytest.mark.parametrize("argmaxes,num_draft,expected", GREEDY_TREE_TABLE)
@pytest.mark.parametrize("fast", [False, True], ids=["uniforms", "all-greedy-flag"])
def test_greedy_tree_walk(argmaxes, num_draft, expected, fast):
    sampling = SamplingTensors.from_params([SamplingParams(seed=0)])
    logits = torch.zeros(1, len(argmaxes), V)
    for i, tok in enumerate(argmaxes):
        logits[0, i, tok] = 5.0
    draft = DraftBlock(torch.tensor([TOKENS]), torch.tensor([num_draft]), parents=torch.tensor([PARENTS]))
    steps = torch.zeros(1, dtype=torch.int64)
    out = accept(verify(logits, draft, sampling, steps), draft, sampling.seeds, steps, all_greedy=fast)
    n = int(out.num_accepted[0])
    assert out.tokens[0, : n + 1].tolist() == expected
    path = [TOKENS[i] for i in out.path[0].tolist() if i >= 0]
    assert path == expected[:-1]


def test_a_chain_as_a_tree_gives_the_chains_verdicts():
    """The same draws as a chain (node i under node i - 1), greedy and sampled rows mixed."""
    g = torch.Generator().manual_seed(0)
    B, K = 64, 4
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    tokens = torch.randint(0, V, (B, K), generator=g)
    probs = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    sampling = SamplingTensors.from_params([SamplingParams(temperature=[0.0, 0.7, 1.0][b % 3], seed=b)
                                            for b in range(B)])
    steps = torch.arange(B)
    num = torch.randint(0, K + 1, (B,), generator=g)
    ids = torch.arange(V).expand(B, K, V).clone()
    chain = DraftBlock(tokens, num, ids, probs)
    tree = dataclasses.replace(chain, parents=torch.arange(-1, K - 1).expand(B, K).clone())
    a = accept(verify(logits, chain, sampling, steps), chain, sampling.seeds, steps)
    b = accept(verify(logits, tree, sampling, steps), tree, sampling.seeds, steps)
    assert torch.equal(a.num_accepted, b.num_accepted)
    for r in range(B):
        n = int(a.num_accepted[r])
        assert a.tokens[r, : n + 1].tolist() == b.tokens[r, : n + 1].tolist()


# ---- statistical exactness with siblings --------------------------------------------------------------------------
# A context-free target: a fixed distribution per fed position (pending, then each node). A correct sampler emits,
# right after reaching node n (or at the start, for the pending token), a token distributed as the warped target at
# n, whatever the drafts were. The tree has three siblings under the pending token and two under node 0.

TREE = [-1, -1, -1, 0, 0, 1, 3]
N = 40_000
ALPHA = 1e-4


def _tree_passes(temperature: float, top_p: float, children: str, broken: str | None = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    K = len(TREE)
    target_logits = torch.randn(K + 1, V, generator=g) * 1.5  # per fed position
    # per parent fed position: a draft close to the target, so that second siblings get accepted too
    draft_logits = target_logits + torch.randn(K + 1, V, generator=g)
    seeds = torch.arange(N, dtype=torch.int64) * 7919 + 13
    steps = torch.full((N,), 3, dtype=torch.int64)
    sampling = SamplingTensors.from_params([SamplingParams(temperature=temperature, top_p=top_p, seed=int(s))
                                            for s in seeds])
    one = sampling.select([0])
    target = warp(target_logits[None], one)[0]  # [K+1, V] what the output must follow
    draft = warp(draft_logits[None], one)[0]  # [K+1, V] the draft at each parent
    parents = torch.tensor(TREE)
    tokens = torch.zeros(N, K, dtype=torch.int64)
    shipped = torch.zeros(N, K, V)
    u = uniform(seeds, steps, Stream.DRAFT, K)
    drawn: dict[int, torch.Tensor] = {}
    for n in range(K):
        p = int(parents[n]) + 1
        if children == "sampled":  # without replacement, each sibling shipping what it was drawn from
            before = drawn.get(p, torch.zeros(N, V, dtype=torch.bool))
            choice, q, drawn[p] = draw_without_replacement(draft[p].expand(N, V), before, u[:, n])
            tokens[:, n] = choice
            shipped[:, n] = draft[p] if broken == "not_renormalised" else q
        else:  # the draft's top tokens in order, as point masses
            rank = sum(1 for m in range(n) if TREE[m] == TREE[n])
            tokens[:, n] = draft[p].argsort(descending=True)[rank]
            shipped[:, n] = torch.nn.functional.one_hot(tokens[:, n], V).float()
    block = DraftBlock(tokens, torch.full((N,), K), torch.arange(V).expand(N, K, V).clone(), shipped,
                       parents.expand(N, K).clone())
    logits = target_logits.expand(N, K + 1, V).clone()
    verified = verify(logits, block, sampling, steps)
    if broken == "accept_always":
        verified = dataclasses.replace(verified, accept_probs=torch.ones_like(verified.accept_probs))
    elif broken == "recover_from_target":  # the recovered token ignores what the siblings took away
        tgt = target.expand(N, K + 1, V).reshape(-1, V)
        drawn_tokens = sample_from_probs(tgt, uniform(seeds, steps, Stream.TARGET, K + 1).reshape(-1))
        verified = VerifyOutput(verified.accept_probs, drawn_tokens.view(N, K + 1))
    out = accept(verified, block, seeds, steps)
    return out, target


def _pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=V).double()
    keep = probs > 0
    if counts[~keep].sum() > 0:  # a token the target cannot emit: as far from the target as it gets
        return 0.0
    exp = probs.double()[keep].numpy()
    return float(chisquare(counts[keep].numpy(), exp * counts.sum().item() / exp.sum()).pvalue)


def _pvalues(out, target) -> dict[str, float]:
    """The emitted token after the pending token and after each node reached often enough, against the target."""
    pv = {"pending": _pvalue(out.tokens[:, 0], target[0])}
    for n in range(len(TREE)):
        for d in range(len(TREE)):
            reached = out.path[:, d] == n
            if reached.sum() >= 2000:
                pv[f"node {n}"] = _pvalue(out.tokens[reached, d + 1], target[n + 1])
    return pv


@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.9), (1.0, 0.9), (1.0, 1.0)])
@pytest.mark.parametrize("children", ["sampled", "top-k"])
def test_tree_output_follows_the_target(temperature, top_p, children):
    out, target = _tree_passes(temperature, top_p, children)
    pv = _pvalues(out, target)
    assert len(pv) >= 3, f"too few nodes reached to test: {pv}"
    assert min(pv.values()) > ALPHA, f"deviates from the target: {pv}"
    # real multi-draft speculation: later siblings (nodes 1, 2, 4) get accepted, and whole passes get rejected too
    later = (out.path[..., None] == torch.tensor([1, 2, 4])).any(-1).any(-1)
    assert later.float().mean() > 0.02
    assert 0.05 < (out.num_accepted == 0).float().mean() < 0.95


@pytest.mark.parametrize("broken", ["accept_always", "recover_from_target", "not_renormalised"])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_negative_controls_fail_the_tree_test(broken, temperature):
    out, target = _tree_passes(temperature, 0.9, "sampled", broken=broken)
    pv = _pvalues(out, target)
    assert min(pv.values()) < 1e-6, f"a broken sampler passed the tree exactness test: {pv}"


# ---- the engine with trees ---------------------------------------------------------------------------------------

PROMPTS = [[5, 17, 33, 17, 33, 9], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 7]]


# an explicit shape (TreeConfig.paths, e.g. a `specserve tune-tree` file): wide at the root, deeper on rank 0
EXPLICIT_TREE = TreeConfig(paths=((0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)))


@pytest.mark.parametrize("tree", [TreeConfig((3, 2, 1)), TreeConfig((4, 2, 2, 1), max_nodes=9), EXPLICIT_TREE],
                         ids=["3x2x1", "budget-9", "explicit"])
@pytest.mark.parametrize("drafter", ["draft", "self"])
def test_greedy_trees_equal_the_targets_output(tiny_models, target, tree, drafter):
    cfg = EngineConfig(max_batch_size=4, max_seq_len=128)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [r.token_ids for r in SpeculativeEngine(target, None, None, cfg).generate_batch(PROMPTS, params)]
    draft_model = load_model(tiny_models["draft" if drafter == "draft" else "llama"])[0]
    graph_calls = target.stats.graph_calls if isinstance(target, GraphCausalLM) else 0
    engine = SpeculativeEngine(target, None, ModelDrafter(draft_model), dataclasses.replace(cfg, tree=tree))
    assert [r.token_ids for r in engine.generate_batch(PROMPTS, params, SpecParams(4))] == want
    if isinstance(target, GraphCausalLM):  # the tree passes took the static path
        assert target.stats.graph_calls > graph_calls
    for prompt, w in zip(PROMPTS, want):
        r = engine.generate(prompt, params, SpecParams(4))
        assert r.token_ids == w
    if drafter == "self":  # the target drafting for itself: every pass accepts the whole depth
        depth = len(tree.branching)
        assert r.stats["target_passes"] == -(-24 // (depth + 1))


def test_sampled_trees_replay_and_do_not_depend_on_the_batch(tiny_models, target):
    cfg = EngineConfig(max_batch_size=4, max_seq_len=128, tree=TreeConfig((3, 2, 1)))
    engine = SpeculativeEngine(target, None, ModelDrafter(load_model(tiny_models["draft"])[0]), cfg)
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    singles = [engine.generate(p, q, SpecParams(3)).token_ids for p, q in zip(PROMPTS, params)]
    batched = [r.token_ids for r in engine.generate_batch(PROMPTS, params, SpecParams(3))]
    assert singles == batched


def test_a_tree_without_a_draft_model_is_refused(target):
    from pipeline.drafters import PromptLookupDrafter

    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeEngine(target, None, PromptLookupDrafter(), EngineConfig(tree=TreeConfig()))


def test_a_target_without_tree_attention_keeps_chains(tiny_models, target, caplog):
    drafter = ModelDrafter(load_model(tiny_models["draft"])[0])
    with caplog.at_level("WARNING"):
        engine = SpeculativeEngine(NoTreeRunner(target), None, drafter,
                                   EngineConfig(max_seq_len=128, tree=TreeConfig()))
    assert engine.drafter is drafter and "drafting chains instead" in caplog.text
