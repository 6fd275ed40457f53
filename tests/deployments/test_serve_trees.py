"""Token trees of a draft model in the Serve pipeline (`drafter.tree` with a draft model on drafter replicas): the
drafter worker drafts trees with the engine's `TreeDrafter`, they travel as nodes, parents and sparse probabilities,
and the target worker verifies them with its tree attention and keeps the accepted path (`verify_and_accept`, the
engine's).

The first tests drive the worker classes by hand (no Ray), the coordinator's loop in miniature: every step is the
engine's with the same tree, greedy and seeded; some steps accept a path off the drafter's favourite children (the
target's cache was compacted to it, or the later steps would differ); the drafter's cache follows the accepted path
(each call feeds only the tokens committed since its last one). Then the config: which drafters a tree takes, with
clear refusals. The last runs the whole app (real Ray, real Redis, the `openai` client over HTTP): greedy output
equals the engine's with the same tree and the target's own; a seeded request replays and equals the engine's.

The draft model is the tiny target with noise on its weights: it agrees with the target often enough that trees accept
side branches (a random drafter would accept almost nothing).
"""

from __future__ import annotations

import asyncio
import shutil

import pytest
from pydantic import ValidationError

from deployments.config import DRAFTER, AppConfig, DrafterConfig, deployment_options
from pipeline.config import TreeConfig

K = 4
MAX_SEQ_LEN = 256
TREE = TreeConfig((3, 2, 2, 1), max_nodes=8)
PROMPT = [1, 17, 42, 99, 5, 61]
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 7}


def noisy_copy(src, dst, scale: float, seed: int):
    """A copy of the model folder `src` whose matrices carry Gaussian noise of `scale` times their own spread."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(seed)
    for f in dst.glob("*.safetensors"):
        weights = load_file(f)
        save_file({k: v + scale * v.std() * torch.randn(v.shape, generator=gen) if v.dim() > 1 else v
                   for k, v in weights.items()}, f, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_trees")
    return {"target": str(tiny_models["llama"]),
            "draft": str(noisy_copy(tiny_models["llama"], root / "draft", scale=0.1, seed=5))}


def engine_result(models, sampling: dict, tree: TreeConfig | None = TREE, max_tokens: int = 40, drafter: bool = True):
    """The in-process engine's steps (token ids committed per target pass) and result, drafting `tree` (None: chains)
    with the draft model (`drafter` False: target-only)."""
    from pipeline.config import EngineConfig, SamplingParams, SpecParams
    from pipeline.drafters import ModelDrafter
    from pipeline.engine import SpeculativeEngine
    from pipeline.models.loader import load_model

    target, _ = load_model(models["target"])
    draft = ModelDrafter(load_model(models["draft"])[0]) if drafter else None
    engine = SpeculativeEngine(target, None, draft, EngineConfig(max_batch_size=2, max_seq_len=MAX_SEQ_LEN, tree=tree))
    events = list(engine.stream(PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling),
                                SpecParams(K)))
    return [e.token_ids for e in events], events[-1].result


def run_workers(models, params, tree: TreeConfig = TREE):
    """The coordinator's loop over a drafter worker drafting trees and a target worker verifying them. -> steps, the
    request's state, each step's (draft, verdict), and per propose call after the first: (tokens its draft cache kept,
    the context length of the call before)."""
    from deployments.drafter_replica import DrafterWorker
    from deployments.messages import ProposeCall, VerifyCall
    from deployments.target_replica import TargetWorker
    from pipeline.drafters import _common_prefix
    from pipeline.sequence import RequestState
    from pipeline.step import Draft, commit, draft_budgets

    drafter = DrafterWorker(models["draft"], max_batch_size=2, max_seq_len=MAX_SEQ_LEN, target=models["target"],
                            tree=tree)
    target = TargetWorker(models["target"], max_batch_size=2, max_seq_len=MAX_SEQ_LEN)
    for w in (drafter, target):
        asyncio.run(w.admit("r"))
    model_drafter, kept = drafter.drafter, []
    feed = model_drafter.feed_context

    def spy(rows):  # what the draft cache still holds of each call's context
        kept.append(_common_prefix(list(model_drafter.cached("r")), list(rows[0].context)))
        return feed(rows)

    model_drafter.feed_context = spy
    state = RequestState("r", list(PROMPT), params)
    steps, passes, lengths, base = [], [], [], 0
    while not state.finished:
        [want], _ = draft_budgets([state], K)
        draft = Draft([])
        if want > 0:
            lengths.append(state.length)
            got = drafter._run_batch([ProposeCall("r", base, state.context[base:], want, params, state.step, 64,
                                                  tree=True)])[0]
            draft, base = got.head(want), state.length
        call = VerifyCall("r", state.length - 1, state.last_token, draft, params, state.step,
                          prefix=None if steps else state.context[:-1])
        verdict = target._run_batch([call])[0]
        passes.append((draft, verdict))
        steps.append(commit(state, verdict)[0])
    return steps, state, passes, list(zip(kept[1:], lengths))


def first_children(draft) -> list[int]:
    """The tokens of a tree's path through each node's first child (the drafter's favourites)."""
    path, node = [], -1
    while True:
        node = next((i for i, p in enumerate(draft.parents) if p == node), None)
        if node is None:
            return path
        path.append(draft.tokens[node])


def test_a_tree_travels_as_nodes_and_parents_and_is_cut_by_depth():
    """`Draft.head(n)` keeps a tree's nodes above depth n; `pack` stacks a tree beside a chain (one child a node) and
    an empty row, padding nodes hanging as a chain."""
    import numpy as np

    from pipeline.step import Draft, pack

    probs = np.ones((5, 1), dtype=np.float32)
    tree = Draft([10, 11, 12, 13, 14], np.arange(5)[:, None] + 10, probs, parents=[-1, -1, 0, 0, 2])  # depths 0 0 1 1 2
    assert tree.head(1).tokens == [10, 11] and tree.head(1).parents == [-1, -1]
    assert tree.head(2).parents == [-1, -1, 0, 0] and tree.head(2).top_ids.shape == (4, 1)
    assert tree.head(3).tokens == tree.head(9).tokens == tree.tokens and tree.head(9).parents == tree.parents
    assert Draft([7, 8, 9]).head(2).tokens == [7, 8]
    block = pack([tree, Draft([7, 8]), Draft([])])
    assert block.token_ids.tolist() == [[10, 11, 12, 13, 14], [7, 8, 0, 0, 0], [0] * 5]
    assert block.num_draft.tolist() == [5, 2, 0]
    assert block.parents.tolist() == [[-1, -1, 0, 0, 2], [-1, 0, 1, 2, 3], [-1, 0, 1, 2, 3]]
    assert pack([Draft([7, 8])]).parents is None  # chains stay chains


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_the_workers_run_the_engines_tree_steps(models, sampling):
    from pipeline.config import SamplingParams

    want_steps, result = engine_result(models, sampling)
    params = SamplingParams(max_tokens=40, ignore_eos=True, **{"seed": result.seed, **sampling})
    steps, state, passes, kept = run_workers(models, params)
    assert steps == want_steps
    assert state.stats.drafted == result.stats["drafted"] > 0 and state.stats.accepted == result.stats["accepted"]
    trees = [d for d, _ in passes if d.tokens]
    assert all(len(d.parents) == len(d.tokens) == len(d.top_ids) for d in trees)
    assert max(len(d.tokens) for d in trees) == TREE.max_nodes  # whole trees, not chains, went to the target
    # the drafter's cache followed the accepted path: each call re-fed only what the step before committed
    assert kept and all(k >= length for k, length in kept), kept
    if sampling is GREEDY:  # a path off the favourite children was accepted (the target cache kept it)
        assert any(v.tokens[:v.num_accepted] != first_children(d)[:v.num_accepted] for d, v in passes)
        assert state.output_ids == engine_result(models, GREEDY, tree=None, drafter=False)[1].token_ids


def test_a_target_without_tree_attention_says_so_and_gets_chains(models, tmp_path):
    """The coordinator asks for trees only where the target worker's info says it verifies them (the generic runner
    does not); a call that does not ask gets the draft model's chain."""
    from deployments.drafter_replica import DrafterWorker
    from deployments.messages import ProposeCall
    from deployments.target_replica import TargetWorker
    from pipeline.config import SamplingParams
    from tests.support.models import make_tiny_gpt2

    generic = TargetWorker(str(make_tiny_gpt2(tmp_path / "gpt2", vocab_size=128)), max_batch_size=1, max_seq_len=64)
    fast = TargetWorker(models["target"], max_batch_size=1, max_seq_len=64)
    assert asyncio.run(generic.info())["supports_tree"] is False and asyncio.run(fast.info())["supports_tree"] is True
    drafter = DrafterWorker(models["draft"], max_batch_size=2, max_seq_len=64, tree=TREE)
    params = SamplingParams(max_tokens=8, temperature=0.0, seed=0)
    for rid, tree in (("chain", False), ("tree", True)):
        asyncio.run(drafter.admit(rid))
        got = drafter._run_batch([ProposeCall(rid, 0, PROMPT, K, params, 0, 64, tree=tree)])[0]
        assert (len(got.tokens), got.parents is None) == ((K, True) if not tree else (TREE.max_nodes, False))


# -- the config ------------------------------------------------------------------------------------------


def test_a_draft_model_alone_drafts_trees_on_drafter_replicas():
    cfg = AppConfig(drafter={"draft": "smollm2-135m-distill", "tree": {"branching": [3, 2, 2, 1], "max_nodes": 8}})
    assert cfg.model_tree == TreeConfig((3, 2, 2, 1), 8) and DRAFTER in deployment_options(cfg)
    tuned = AppConfig(drafter={"draft": "/models/draft", "tree": {"paths": [[0], [1], [0, 0]]}}).model_tree
    assert tuned.branching == (2, 1) and len(tuned.paths) == 3
    # a tensor-parallel target has no tree attention: the draft model drafts chains (logged where it runs)
    tp = AppConfig(drafter={"draft": "/models/draft", "tree": {"branching": [2, 2]}},
                   target={"tensor_parallel_size": 2})
    assert tp.model_tree is None
    assert AppConfig(drafter={"draft": "/models/draft"}).model_tree is None
    # a head's trees are the target worker's own
    assert AppConfig(drafter={"draft": "eagle3:/heads/e3", "tree": {"branching": [2, 2]}}).model_tree is None


@pytest.mark.parametrize("draft, reason", [
    ("lookup+smollm2-135m-distill", "not behind 'lookup\\+'"),
    ("prompt-lookup", "draft model alone"),
    ("suffix", "draft model alone"),
    ("none", "draft model alone"),
    ("synthetic:0.8:llama-1b:rec.json", "draft model alone"),
])
def test_trees_refuse_drafters_that_are_not_a_draft_model_alone(draft, reason):
    with pytest.raises(ValidationError, match=reason) as err:
        DrafterConfig(draft=draft, tree={"branching": [2, 2]})
    assert f"drafter.draft is {draft!r}" in str(err.value)


def test_a_draft_models_tree_is_static():
    with pytest.raises(ValidationError, match="dynamic tree is drafted by an EAGLE-3 head"):
        DrafterConfig(draft="smollm2-135m-distill", tree={"branching": [3, 3], "max_nodes": 6, "dynamic": True})


# -- the whole app: real Ray, real Redis, the openai client over HTTP --------------------------------------------


@pytest.fixture(scope="module")
def app(models):
    from ray import serve

    from deployments.app import build_app
    from tests.support.serve import run_app

    config = {
        "served_model_name": "tiny-tree",
        "target": {"model": models["target"], "max_seq_len": MAX_SEQ_LEN, "max_batch_size": 2},
        # the coordinator's defaults (overlap, adaptive K) stand: trees turn them off themselves
        "drafter": {"draft": models["draft"], "max_batch_size": 2,
                    "tree": {"branching": list(TREE.branching), "max_nodes": TREE.max_nodes}},
        "speculation": {"num_draft_tokens": K},
    }
    url = run_app(build_app(config), "trees")
    yield url, config["served_model_name"]
    serve.delete("trees")


@pytest.mark.slow
def test_served_draft_model_trees_equal_the_engine(models, app):
    import openai

    url, model = app
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    _, want = engine_result(models, GREEDY)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].token_ids == want.token_ids
    assert want.token_ids == engine_result(models, GREEDY, tree=None, drafter=False)[1].token_ids
    spec = out.speculation
    assert spec["drafted"] == want.stats["drafted"] > 0 and spec["accepted"] == want.stats["accepted"]
    assert spec["target_passes"] == want.stats["target_passes"]
    assert spec["adaptive_k"] is False and spec["overlap_tries"] == 0  # a static shape, no pre-speculation
    seeded = dict(model=model, prompt=PROMPT, max_tokens=40, temperature=0.9, top_p=0.95, seed=7,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(**seeded).choices[0].token_ids
    again = client.completions.create(**seeded).choices[0].token_ids
    assert first == again == engine_result(models, SEEDED)[1].token_ids


@pytest.mark.slow
def test_served_trees_of_concurrent_requests_give_the_engines_tokens(models, app):
    """Two greedy streams at once (their trees may meet in a target pass, of other sizes near a request's end): each
    request's output is the engine's."""
    import openai

    url, model = app
    prompts, lengths = [PROMPT, [3, 9, 27, 81, 2]], [37, 29]

    async def one(client, prompt, n):
        out = await client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                              extra_body={"ignore_eos": True})
        return out.choices[0].token_ids

    async def both():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*[one(client, p, n) for p, n in zip(prompts, lengths)])

    from pipeline.config import EngineConfig, SamplingParams, SpecParams
    from pipeline.drafters import ModelDrafter
    from pipeline.engine import SpeculativeEngine
    from pipeline.models.loader import load_model

    engine = SpeculativeEngine(load_model(models["target"])[0], None, ModelDrafter(load_model(models["draft"])[0]),
                               EngineConfig(max_batch_size=2, max_seq_len=MAX_SEQ_LEN, tree=TREE))
    want = [engine.generate(p, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0), SpecParams(K)).token_ids
            for p, n in zip(prompts, lengths)]
    assert asyncio.run(both()) == want
