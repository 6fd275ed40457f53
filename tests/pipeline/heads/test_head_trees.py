"""Token trees drafted by the feature heads (EAGLE-3, Medusa): the head's tree levels against chains along each path,
its cache after a tree (no compaction), greedy output equal to the target's, the first emitted token of sampled
trees against the target's distribution (with a negative control that must fail), seeded replay."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.config import EngineConfig, SamplingParams, SpecParams, TreeConfig
from pipeline.drafters import HybridDrafter, ModelDrafter, ProposeRow, build_drafter
from pipeline.engine import SpeculativeEngine
from pipeline.heads.drafter import HeadDrafter, eagle3_dynamic_tree, eagle3_tree, medusa_tree, tree_plan
from pipeline.models.graphs import GraphCausalLM, GraphConfig
from pipeline.models.loader import load_model
from pipeline.rejection import accept, verify
from pipeline.sampling import SamplingTensors, warp
from pipeline.tree import tree_shape
from tests.pipeline.test_rejection import ALPHA, _pvalue
from tests.support.heads import make_eagle3_checkpoint, make_medusa_checkpoint
from tests.support.models import NoTreeRunner, make_tiny_llama

V = 128
STATIC = GraphConfig(graphs=False, compile=False, attention="sdpa", linear="torch")  # the graph path, uncaptured
PROMPTS = [[1, 5, 9, 17, 33, 65], [3, 4], [7] * 12 + [8, 9, 10], [100, 2, 50, 51, 52, 53, 54, 55, 56]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("head_trees")
    target = make_tiny_llama(root / "target", vocab_size=V, hidden=32, layers=6, heads=4, kv_heads=2,
                             max_position_embeddings=512, seed=11)
    cfg = json.loads((target / "config.json").read_text())
    return {"target": target, "medusa": make_medusa_checkpoint(root / "medusa", 32, V, heads=3, layers=1, seed=1),
            "eagle3": make_eagle3_checkpoint(root / "eagle3", cfg, draft_vocab=96, seed=3)}


def _drafter(setup, name: str):
    model, tok = load_model(str(setup["target"]))
    drafter = build_drafter(f"{name}:{setup[name]}", model.info, tok, target=model)
    assert isinstance(drafter, HeadDrafter)
    return model, tok, drafter


def _observed(setup, name: str, slots: int, context: list[int] = PROMPTS[0]):
    """A target and a head drafter that has observed `context`'s prompt states under request ids r0.. r{slots-1}."""
    model, tok, drafter = _drafter(setup, name)
    model.allocate(1, 64)
    drafter.allocate(slots, 64)
    feats = model.forward_features(torch.tensor([context[:-1]]), torch.zeros(1, dtype=torch.int64),
                                   torch.zeros(1, dtype=torch.int64), drafter.feature_layers)[1][0]
    for i in range(slots):
        drafter.admit(f"r{i}", context)
        drafter.observe(f"r{i}", 0, feats, context[1:])
    return model, drafter


# ---- the EAGLE-3 head's tree against chains ------------------------------------------------------------------------

TREE = TreeConfig((3, 2, 1), max_nodes=8)


def test_eagle3_tree_levels_equal_a_chain_along_each_path(setup):
    """Every node's logits from the level-by-level tree calls equal those of its root-to-node path drafted as a chain
    (one `Eagle3Head.step` per token, from the same committed pairs in another slot); and after the next read of
    the committed pairs over the tree region, the head's logits equal those of a slot that never held a tree."""
    _, drafter = _observed(setup, "eagle3", slots=2)
    head, shape = drafter.head, tree_shape(TREE)
    states = [drafter._rows["r0"], drafter._rows["r1"]]
    logits, r = drafter._read(states)  # both slots hold the prompt's pairs; the pending token is at `fed`
    pending = torch.tensor([states[0].fed])
    slot0, slot1 = torch.tensor([0]), torch.tensor([1])
    greedy = SamplingTensors.from_params([SamplingParams(seed=0)])
    node_logits = {}  # node -> the head's logits there (the distribution of its children)
    step = head.step

    def recording(tokens, features, positions, slots, fused, span=None, tree=None):
        lg, rr = step(tokens, features, positions, slots, fused, span, tree)
        if tree is not None:
            for j in range(tokens.shape[1]):
                node_logits[tree.first + j] = lg[0, j]
        return lg, rr

    head.step = recording
    u = torch.zeros(1, shape.num_nodes, dtype=torch.float64)
    tokens = eagle3_tree(head, logits[:1], r[:1], pending, slot0, shape, shape.depth, greedy, u, 8,
                         drafter._out_ids, tree_plan(shape, shape.depth, torch.device("cpu")))[0][0].tolist()
    head.step = step
    assert len(node_logits) == shape.nodes_within(shape.depth - 1) and len(set(tokens)) > 1
    for n in node_logits:
        path, j = [], n
        while j >= 0:
            path.insert(0, j)
            j = shape.parents[j]
        rr = r[1:]
        for d, m in enumerate(path):  # a chain along the path, in slot 1
            lg, rr = head.step(torch.tensor([[tokens[m]]]), rr[:, None], pending + d, slot1, fused=False)
            rr = rr[:, 0]
        torch.testing.assert_close(node_logits[n], lg[0, 0], rtol=1e-4, atol=1e-4)
    # Accept the path 0 -> 3: slot 0's tree region holds all 8 nodes, slot 1 at most a 3-token chain. Reading the
    # committed pairs overwrites the first 3 entries of each, and the next logits agree.
    assert shape.parents[3] == 0
    feats = torch.randn(3, drafter.feature_width)
    for request_id in ("r0", "r1"):
        drafter.observe(request_id, int(pending), feats, [tokens[0], tokens[3], 9])
    after_tree, after_chain = drafter._read([states[0]]), drafter._read([states[1]])
    torch.testing.assert_close(after_tree, after_chain, rtol=1e-5, atol=1e-5)


def test_medusa_greedy_tree_is_the_product_of_each_heads_top_tokens(setup):
    """Greedy: the node at depth d of rank r is head d's r-th token under every parent, a point mass."""
    _, _, drafter = _drafter(setup, "medusa")
    shape = tree_shape(TreeConfig((3, 2, 2)))
    features = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    sampling = SamplingTensors.from_params([SamplingParams(seed=0)] * 2)
    u = torch.rand(2, shape.num_nodes, dtype=torch.float64)
    tokens, _, probs = medusa_tree(drafter.head, features, shape, shape.depth, sampling, u, 8)
    logits = drafter.head(features)  # [2, K, V]
    for n in range(shape.num_nodes):
        want = logits[:, shape.depths[n]].topk(3).indices[:, shape.ranks[n]]
        assert tokens[:, n].tolist() == want.tolist()
    assert probs[:, :, 0].eq(1).all()


# ---- the target side ---------------------------------------------------------------------------------------------


def test_a_verified_tree_returns_the_accepted_paths_features_as_a_chain_does(setup):
    """`verify_and_accept` with a tree and a head's layers: the verdict's features are the target's states at the
    pending token and along the accepted path, equal to a chain pass over that path; the target's cache is
    compacted to the path."""
    from pipeline.models.llama import FINAL_NORMED
    from pipeline.rejection import DraftBlock
    from pipeline.step import verify_and_accept

    model = load_model(str(setup["target"]))[0]
    model.allocate(3, 64)
    prompt = torch.tensor([[5, 17, 33, 9, 41]])
    for slot in range(3):
        model.forward(prompt, torch.tensor([0]), torch.tensor([slot]))
    pending, start, layers = 7, torch.tensor([5]), (2, FINAL_NORMED)
    greedy = []  # the target's own greedy continuation: a path through the tree it accepts
    for _ in range(2):
        logits = model.forward(torch.tensor([[pending] + greedy]), start, torch.tensor([2]))
        greedy.append(int(logits[0, -1].argmax()))
    miss = [(g + 1) % V for g in greedy]
    # nodes: 0, 1 under pending; 2, 3 under node 1; the accepted path is node 1 -> node 3
    tokens, parents = [miss[0], greedy[0], miss[1], greedy[1]], [-1, -1, 1, 1]
    draft = DraftBlock(torch.tensor([tokens]), torch.tensor([4]), parents=torch.tensor([parents]))
    sampling = SamplingTensors.from_params([SamplingParams(seed=0)])
    verdict = verify_and_accept(model, torch.tensor([pending]), draft, start, torch.tensor([0]), sampling,
                                torch.zeros(1, dtype=torch.int64), layers)[0]
    assert verdict.num_accepted == 2 and verdict.tokens[:2] == greedy and verdict.num_draft == 2
    _, chain = model.forward_features(torch.tensor([[pending] + greedy]), start, torch.tensor([1]), layers)
    torch.testing.assert_close(verdict.features, chain[0], rtol=1e-4, atol=1e-4)
    nxt = torch.tensor([[verdict.tokens[2]]])  # the compacted cache continues as the chain's
    torch.testing.assert_close(model.forward(nxt, start + 3, torch.tensor([0])),
                               model.forward(nxt, start + 3, torch.tensor([1])), rtol=1e-4, atol=1e-4)


# ---- the engine -------------------------------------------------------------------------------------------------


def _engine(setup, name: str | None, tree: TreeConfig | None = None, static: bool = False) -> SpeculativeEngine:
    """The engine over the setup's target (static: on the static-shape graph path, uncaptured, SDPA attention)."""
    model, tok = load_model(str(setup["target"]))
    drafter = build_drafter(f"{name}:{setup[name]}", model.info, tok, target=model) if name else None
    if static:
        model = GraphCausalLM(model, STATIC)
    return SpeculativeEngine(model, tok, drafter, EngineConfig(max_batch_size=4, max_seq_len=256, tree=tree))


# an explicit shape (TreeConfig.paths, e.g. a `specserve tune-tree` file): wide at the root, deeper on rank 0
EXPLICIT_TREE = TreeConfig(paths=((0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)))


@pytest.mark.parametrize("tree", [TreeConfig((3, 2, 1)), TreeConfig((4, 2, 2, 1), max_nodes=9), EXPLICIT_TREE],
                         ids=["3x2x1", "budget-9", "explicit"])
@pytest.mark.parametrize("name", ["eagle3", "medusa"])
@pytest.mark.parametrize("path", ["eager", "static"])
def test_greedy_head_trees_equal_the_targets_output(setup, name, tree, path):
    """On the eager runner and on the static-shape graph path (its tree attention and `compact`)."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [r.token_ids for r in _engine(setup, None).generate_batch(PROMPTS, params)]
    engine = _engine(setup, name, tree, static=path == "static")
    engine.head.static = engine.head.eagle and path == "static"  # the GPU's captured draft, run uncaptured
    assert engine.head is engine.drafter and engine.head.tree is not None and engine.k_policy is None
    got = engine.generate_batch(PROMPTS, params, SpecParams(4))
    assert [r.token_ids for r in got] == want
    assert sum(r.stats["drafted"] for r in got) > 0
    assert max(engine.timings.steps_by_k) > 4  # passes verified more nodes than a chain of K = 4 has
    assert engine.generate(PROMPTS[1], params, SpecParams(4)).token_ids == want[1]  # alone, in a reused slot
    if path == "static":  # the tree passes ran on the static path, an EAGLE-3 head's drafts on static buffers
        assert engine.target.stats.graph_calls > engine.target.stats.eager_calls
        assert any(k[0] == "static tree" for k in engine.head._chains) == engine.head.eagle


def test_head_trees_stay_off_the_device_loop(setup):
    """`EngineConfig.device_loop=True` runs a head's chains on the loop (CPU too); a tree keeps the step path."""
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = [r.token_ids for r in _engine(setup, None).generate_batch(PROMPTS[:2], params)]
    model, tok = load_model(str(setup["target"]))
    drafter = build_drafter(f"eagle3:{setup['eagle3']}", model.info, tok, target=model)
    cfg = EngineConfig(max_batch_size=4, max_seq_len=256, tree=TreeConfig((2, 2)), device_loop=True)
    engine = SpeculativeEngine(model, tok, drafter, cfg)
    assert [r.token_ids for r in engine.generate_batch(PROMPTS[:2], params, SpecParams(2))] == want
    assert not engine._loops and max(engine.timings.steps_by_k) == 6


@pytest.mark.parametrize("name, static", [("eagle3", False), ("eagle3", True), ("medusa", False)])
def test_sampled_head_trees_replay_and_do_not_depend_on_the_batch(setup, name, static):
    """static: the EAGLE-3 head's trees on static buffers over a fixed span (`_StaticFixedTree`, the GPU's captured
    draft, run uncaptured): the same draws as the eager tree."""
    engine = _engine(setup, name, TreeConfig((3, 2, 1)))
    engine.head.static = static
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    singles = [engine.generate(p, q, SpecParams(3)).token_ids for p, q in zip(PROMPTS, params)]
    again = [engine.generate(p, q, SpecParams(3)).token_ids for p, q in zip(PROMPTS, params)]
    batched = [r.token_ids for r in engine.generate_batch(PROMPTS[:3], params, SpecParams(3))]
    assert singles == again == batched
    assert any(k[0] == "static tree" for k in engine.head._chains) == static
    if static:  # the eager tree draws the same tokens from the same seeds
        eager = _engine(setup, name, TreeConfig((3, 2, 1)))
        assert [eager.generate(p, q, SpecParams(3)).token_ids for p, q in zip(PROMPTS, params)] == singles


@pytest.mark.parametrize("static", [False, True])
def test_a_head_behind_prompt_lookup_drafts_trees_where_lookup_finds_nothing(setup, static):
    """`lookup+eagle3:` with a tree: rows whose context repeats an n-gram draft the lookup's chain (a tree of one
    child a node), the others the head's tree, in one block; greedy output is the target's, seeded sampled output
    replays alone and batched."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [r.token_ids for r in _engine(setup, None).generate_batch(PROMPTS, params)]
    model, tok = load_model(str(setup["target"]))
    drafter = build_drafter(f"lookup+eagle3:{setup['eagle3']}", model.info, tok, target=model)
    engine = SpeculativeEngine(GraphCausalLM(model, STATIC) if static else model, tok, drafter,
                               EngineConfig(max_batch_size=4, max_seq_len=256, tree=TreeConfig((3, 2, 1))))
    engine.head.static = static
    assert engine.drafter is drafter and engine.head.tree is not None and engine.k_policy is None
    got = engine.generate_batch(PROMPTS, params, SpecParams(3))
    assert [r.token_ids for r in got] == want
    assert drafter.lookup_rows > 0 and drafter.model_rows > 0  # both kinds of row drafted
    assert max(engine.timings.steps_by_k) > 3  # some passes verified a tree
    sampled = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    singles = [engine.generate(p, q, SpecParams(3)).token_ids for p, q in zip(PROMPTS, sampled)]
    assert singles == [r.token_ids for r in engine.generate_batch(PROMPTS[:3], sampled, SpecParams(3))]


def test_a_hybrid_draft_model_is_refused_with_a_tree(setup):
    model, tok = load_model(str(setup["target"]))
    drafter = HybridDrafter(ModelDrafter(load_model(str(setup["target"]))[0]))
    with pytest.raises(ValueError, match="without 'lookup\\+'"):
        SpeculativeEngine(model, tok, drafter, EngineConfig(max_seq_len=128, tree=TreeConfig()))


def test_a_head_on_a_target_without_tree_attention_keeps_chains(setup, caplog):
    model, tok = load_model(str(setup["target"]))
    drafter = build_drafter(f"eagle3:{setup['eagle3']}", model.info, tok, target=model)
    with caplog.at_level("WARNING"):
        engine = SpeculativeEngine(NoTreeRunner(model), tok, drafter, EngineConfig(max_seq_len=128, tree=TreeConfig()))
    assert engine.drafter is drafter and drafter.tree is None and "drafting chains instead" in caplog.text


# ---- sampled trees: the first emitted token -----------------------------------------------------------------------


def _first_tokens(setup, name: str, n: int, sharpen: float, broken: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """n seeded single-pass requests (T=0.7) from one context, each drafting a 3x2 tree with the head's logits
    multiplied by `sharpen`, verified against the target: the first emitted token (an accepted child of the pending
    token or the recovered one) depends only on the target at the pending token and the pending token's children.
    broken: every child claims the head's
    distribution, not renormalised over the tokens its earlier siblings took (sampling with replacement's claim)."""
    model, drafter = _observed(setup, name, slots=n)
    with torch.no_grad():  # a peaked head: its first child takes much of the mass, which its siblings' claims lose
        for layer in [drafter.head.lm_head] if drafter.eagle else drafter.head.lm_heads:
            layer.weight.mul_(sharpen)
    drafter.draft_trees(TreeConfig((3, 2)))
    context = PROMPTS[0]
    sampling = SamplingTensors.from_params([SamplingParams(temperature=0.7, seed=1000 + i) for i in range(n)])
    steps = torch.zeros(n, dtype=torch.int64)
    block = drafter.propose([ProposeRow(f"r{i}", context, 2) for i in range(n)], 2, sampling, steps, 64)
    assert block.parents[0].tolist()[:3] == [-1, -1, -1] and int(block.num_draft[0]) == 9
    if broken:
        first = block.top_ids[:, :1]
        assert torch.equal(block.top_ids[:, 1:3], first.expand(-1, 2, -1))  # siblings share a support
        block.top_probs = torch.cat([block.top_probs[:, :1].expand(-1, 3, -1), block.top_probs[:, 3:]], dim=1)
    row = block.token_ids[:1]
    fed = torch.cat([torch.tensor([[context[-1]]]), row], dim=1)
    parents = torch.cat([torch.tensor([[-1]]), block.parents[:1] + 1], dim=1)
    from pipeline.models.tree_attention import TreeMask

    t_logits = model.forward(fed, torch.tensor([len(context) - 1]), torch.zeros(1, dtype=torch.int64),
                             tree=TreeMask(parents))
    target_probs = warp(t_logits[:, :1], sampling.select([0]))[0, 0]  # [V] the target at the pending token
    # Rows drafted different trees; the first emitted token depends only on the first position and the pending
    # token's children, whose distributions each row ships, so every row is verified against row 0's logits.
    out = accept(verify(t_logits.expand(n, -1, -1).clone(), block, sampling, steps), block, sampling.seeds, steps)
    return out.tokens[:, 0], target_probs


# the random heads' logits scaled up (`sharpen`) and the rows: enough that the control fails by far (p < 1e-15 here)
@pytest.mark.parametrize("name,sharpen,n", [("eagle3", 8.0, 10_000), ("medusa", 4.0, 30_000)])
def test_sampled_tree_first_token_follows_the_target_and_a_wrong_claim_does_not(setup, name, sharpen, n):
    tokens, target = _first_tokens(setup, name, n, sharpen, broken=False)
    assert _pvalue(tokens, target) > ALPHA
    tokens, target = _first_tokens(setup, name, n, sharpen, broken=True)
    assert _pvalue(tokens, target) < 1e-6


# ---- EAGLE-2's dynamic tree ---------------------------------------------------------------------------------------

DYNAMIC = TreeConfig((3, 3, 3), max_nodes=7, dynamic=True)


def test_dynamic_tree_is_a_tree_of_the_heads_likeliest_children(setup):
    """Parents come first, every node is one of its parent's branching[depth] likeliest children (the head's logits
    along the parent's path, drafted as a chain in another slot), no two siblings repeat a token, and the nodes kept
    are the best-scored: a kept node's path log-probability is at least that of every drafted node left out."""
    _, drafter = _observed(setup, "eagle3", slots=2)
    head = drafter.head
    states = [drafter._rows["r0"], drafter._rows["r1"]]
    logits, r = drafter._read(states)
    pending = torch.tensor([states[0].fed])
    tokens, parents, nodes = eagle3_dynamic_tree(head, logits[:1], r[:1], pending, torch.tensor([0]),
                                                 DYNAMIC.branching, DYNAMIC.max_nodes, torch.tensor([3]),
                                                 drafter._out_ids)
    tokens, parents = tokens[0].tolist(), parents[0].tolist()
    assert int(nodes[0]) == DYNAMIC.max_nodes == len(tokens)
    depth, score = [], []
    for n, p in enumerate(parents):
        assert -1 <= p < n
        path = []
        j = p
        while j >= 0:
            path.insert(0, j)
            j = parents[j]
        lg, rr = logits[1:], r[1:]
        for d, m in enumerate(path):  # the parent's path as a chain, in slot 1
            out_lg, out_r = head.step(torch.tensor([[tokens[m]]]), rr[:, None], pending + d, torch.tensor([1]),
                                      fused=False)
            lg, rr = out_lg[:, 0], out_r[:, 0]
        lp = lg[0].log_softmax(-1)
        ids = drafter._out_ids[lp.topk(DYNAMIC.branching[len(path)]).indices].tolist()
        assert tokens[n] in ids
        depth.append(len(path))
        score.append((score[p] if p >= 0 else 0.0) + float(lp[(drafter._out_ids == tokens[n]).nonzero()[0, 0]]))
    assert depth == sorted(depth) and max(depth) >= 1
    for p in set(parents):
        kids = [tokens[n] for n in range(len(tokens)) if parents[n] == p]
        assert len(kids) == len(set(kids))
    # the pending token's 3 children are all drafted; a left-out child of the root would score below every kept node
    root_lp = logits[0].log_softmax(-1)
    left_out = [float(x) for i, x in zip(drafter._out_ids[root_lp.topk(3).indices].tolist(), root_lp.topk(3).values)
                if i not in [tokens[n] for n in range(len(tokens)) if parents[n] == -1]]
    assert all(s >= max(left_out, default=-1e9) - 1e-3 for s in score)


@pytest.mark.parametrize("tree", [DYNAMIC, TreeConfig((4, 4, 4, 4), max_nodes=12, dynamic=True)],
                         ids=["3x3x3-7", "4x4x4x4-12"])
@pytest.mark.parametrize("path", ["eager", "static"])
def test_greedy_dynamic_trees_equal_the_targets_output(setup, tree, path):
    """On the eager runner; on the static-shape graph path with the head's dynamic tree on static buffers over a fixed
    span (`_StaticTree`, the GPU's captured draft, run uncaptured)."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [r.token_ids for r in _engine(setup, None).generate_batch(PROMPTS, params)]
    engine = _engine(setup, "eagle3", tree, static=path == "static")
    engine.head.static = path == "static"
    assert engine.head.dynamic is tree
    got = engine.generate_batch(PROMPTS, params, SpecParams(4))
    assert [r.token_ids for r in got] == want
    assert sum(r.stats["drafted"] for r in got) > 0
    assert engine.generate(PROMPTS[2], params, SpecParams(2)).token_ids == want[2]  # K = 2 caps the depth
    assert any(k[0] == "tree" for k in engine.head._chains) == (path == "static")


def test_sampled_rows_of_a_dynamic_tree_draft_its_static_shape_and_replay(setup):
    engine = _engine(setup, "eagle3", DYNAMIC)
    params = [SamplingParams(temperature=0.8, max_tokens=12, seed=s, ignore_eos=True) for s in (4, 5)]
    once = [engine.generate(p, q, SpecParams(3)).token_ids for p, q in zip(PROMPTS, params)]
    assert once == [r.token_ids for r in engine.generate_batch(PROMPTS[:2], params, SpecParams(3))]


def test_a_dynamic_tree_needs_an_eagle3_head_and_a_budget(setup):
    with pytest.raises(ValueError, match="node budget"):
        TreeConfig((2, 2), dynamic=True)
    with pytest.raises(ValueError, match="EAGLE-3 head"):
        _engine(setup, "medusa", DYNAMIC)
