"""The fast path's other families (Qwen3, Gemma 2, Gemma 3 text) against HF transformers, on tiny random-weight
models whose sliding window (16) the tests pass: logits, greedy speculative decoding against `generate`, tensor
parallelism, the generic runner's rollback past the window, and which runner each folder gets and why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.models.loader import load_model, runner_choice
from tests.pipeline.models.test_models import TOL, check_against_hf
from tests.support.families import WINDOW, make_tiny_family, tp_rank

transformers = pytest.importorskip("transformers")

FAMILIES = ("qwen3", "gemma2", "gemma3")


@pytest.fixture(scope="module", autouse=True)
def _threads():
    """One thread: these models are tiny, and on a busy 2-core machine a second OpenMP thread makes every small
    matmul wait for a core (10x slower measured)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    made: dict[tuple, Path] = {}

    def get(family: str, seed: int = 0, safetensors: bool = True) -> Path:
        key = (family, seed, safetensors)
        if key not in made:
            made[key] = make_tiny_family(root / f"{family}-{seed}-{safetensors}", family, seed, safetensors)
        return made[key]

    return get


def hf_model(path: Path):
    """HF's reference with its eager attention: the only one that computes Gemma 2's attention soft-capping (its
    SDPA path, the default on CUDA with some transformers versions, leaves it out)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_path_logits_match_hf_past_the_window(family_dir, family):
    """Ragged prefill, ragged decode steps and a rollback (positions up to ~30, past the window of 16)."""
    path = family_dir(family)
    runner, _ = load_model(path)
    hf = hf_model(path)
    assert runner.info.fast_path
    assert runner.info.num_parameters == sum(p.numel() for p in hf.parameters())
    diff = check_against_hf(runner, hf, 96)
    print(f"{family}: max |logits - HF| = {diff:.2e}")
    assert diff < TOL
    # bfloat16 near HF's bfloat16 (measured equal: the norms, the embedding scale and the caps round as HF's do)
    runner, _ = load_model(path, dtype="bfloat16")
    runner.allocate(1, 2 * WINDOW + 8)
    tokens = torch.randint(0, 96, (1, 2 * WINDOW + 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)(tokens).logits.float()
    assert (runner.forward(tokens, torch.tensor([0]), torch.tensor([0])) - ref).abs().max() < 0.02


def test_the_window_the_caps_and_the_rope_bases_are_active(family_dir, tmp_path):
    """What the families add must change the logits (else the HF comparison would not test it): the window past
    16 positions, Gemma 2's soft-caps, Gemma 3's local RoPE base."""
    tokens = torch.randint(0, 96, (1, 2 * WINDOW), generator=torch.Generator().manual_seed(4))

    def logits(path: Path, **changes) -> torch.Tensor:  # the model with `changes` made to its config.json
        if changes:
            variant = tmp_path / f"{path.name}-{len(list(tmp_path.iterdir()))}"
            shutil.copytree(path, variant)
            config = json.loads((path / "config.json").read_text())
            (variant / "config.json").write_text(json.dumps({**config, **changes}))
            path = variant
        runner, _ = load_model(path)
        runner.allocate(1, 2 * WINDOW)
        return runner.forward(tokens, torch.tensor([0]), torch.tensor([0]))[0]

    gemma2, gemma3 = family_dir("gemma2"), family_dir("gemma3")
    base2, base3 = logits(gemma2), logits(gemma3)
    no_window = logits(gemma2, sliding_window=None)
    assert torch.allclose(base2[:WINDOW], no_window[:WINDOW], atol=1e-5)  # the window is not reached yet
    assert (base2[WINDOW:] - no_window[WINDOW:]).abs().max() > 1e-2
    assert (base2 - logits(gemma2, attn_logit_softcapping=None)).abs().max() > 1e-2
    assert base2.abs().max() < 2.0 < logits(gemma2, final_logit_softcapping=None).abs().max()
    rope = json.loads((gemma3 / "config.json").read_text())["rope_parameters"]
    same_base = {**rope, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert (base3 - logits(gemma3, rope_parameters=same_base)).abs().max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculation_equals_hf_generate_past_the_window(family_dir, family):
    """Prompt lookup and a draft model of the same family (other weights: many rejections, so rollbacks on both
    models), 28 tokens after a 12-token prompt: token for token HF's greedy `generate`."""
    from pipeline.config import EngineConfig, SamplingParams, SpecParams
    from pipeline.drafters import ModelDrafter, PromptLookupDrafter
    from pipeline.engine import SpeculativeEngine

    path = family_dir(family)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 9, 5, 6, 7]
    new = 28
    want = hf_model(path).generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)[0, len(prompt):]
    target, _ = load_model(path)
    draft, _ = load_model(family_dir(family, seed=1))
    for drafter in (PromptLookupDrafter(), ModelDrafter(draft)):
        engine = SpeculativeEngine(target, None, drafter, EngineConfig(max_batch_size=1, max_seq_len=64))
        got = engine.generate(prompt, SamplingParams(max_tokens=new), SpecParams(num_draft_tokens=4))
        assert got.token_ids == want.tolist(), type(drafter).__name__


def test_generic_runner_rolls_back_past_the_window(family_dir):
    """A Gemma 2 folder with *.bin weights runs on the generic HF runner; its sliding-window layers keep every
    position, so a rollback past the window works (transformers' own sliding cache cannot crop there)."""
    from pipeline.config import EngineConfig, SamplingParams, SpecParams
    from pipeline.drafters import PromptLookupDrafter
    from pipeline.engine import SpeculativeEngine

    path = family_dir("gemma2", safetensors=False)
    runner, _ = load_model(path)
    assert not runner.info.fast_path
    hf = hf_model(path)
    assert check_against_hf(runner, hf, 96) < TOL
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 9, 5, 6, 7]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    engine = SpeculativeEngine(runner, None, PromptLookupDrafter(), EngineConfig(max_batch_size=1, max_seq_len=48))
    assert engine.generate(prompt, SamplingParams(max_tokens=24), SpecParams(num_draft_tokens=4)).token_ids == want


def test_which_runner_and_why_in_one_line(family_dir, caplog):
    for family in FAMILIES:
        line = runner_choice(family_dir(family))
        assert "fast path" in line and "\n" not in line, line
    gemma3 = runner_choice(family_dir("gemma3"), "cuda")  # reads config.json only: no GPU needed
    assert "; CUDA graph path with " in gemma3 and "(1 + weight) norms" in gemma3 and "per-layer RoPE bases" in gemma3
    assert runner_choice(family_dir("qwen3"), "cuda").endswith("; CUDA graph path with q/k norms")
    gemma2 = runner_choice(family_dir("gemma2"), "cuda")
    assert "; CUDA graph path with " in gemma2 and "attention soft-capping" in gemma2, gemma2
    generic = family_dir("gemma2", safetensors=False)
    assert runner_choice(generic) == f"{generic.name}: generic HF runner, not the fast path: no *.safetensors weights"
    with caplog.at_level("INFO", logger="pipeline.models.loader"):
        load_model(family_dir("qwen3"))
    assert any(r.getMessage() == runner_choice(family_dir("qwen3")) for r in caplog.records)


def test_graph_path_takes_every_family_and_says_what_it_computes(family_dir):
    from pipeline.models.graphs import GraphCausalLM, graph_features, graph_path_reason, maybe_graphs

    runner, _ = load_model(family_dir("gemma2"))
    assert graph_path_reason(runner.args) is None
    assert graph_features(runner.args) == (
        "(1 + weight) norms, post-attention/MLP norms, scaled embeddings, GeGLU, attention soft-capping, "
        "final logit soft-capping, per-layer sliding windows")
    assert isinstance(maybe_graphs(runner), GraphCausalLM)


@pytest.mark.parametrize("family", FAMILIES)
def test_static_path_equals_eager(family_dir, family):
    """Each family on the static-shape path with the SDPA attention (q/k norms in `attn_in`; Gemma's (1 + w)
    norms, post-attention/MLP norms, GeGLU, soft-capping and per-layer windows and RoPE bases in the layer math),
    uncaptured on CPU: ragged rows padded to buckets, past the window (16), equal the eager runner row by row."""
    from pipeline.models.graphs import GraphCausalLM, GraphConfig

    path = family_dir(family)
    static = GraphConfig(graphs=False, compile=False, batch_buckets=(1, 2, 4), token_buckets=(1, 2, 4, 8), kv_block=16)
    graph, _ = load_model(path)
    graph = GraphCausalLM(graph, static)
    assert not graph.fused_layer
    eager, _ = load_model(path)
    graph.allocate(4, 64)
    eager.allocate(4, 64)
    g = torch.Generator().manual_seed(3)
    lengths = {0: 21, 2: 9, 3: 30}
    for slot, n in lengths.items():
        prompt = torch.randint(0, 96, (1, n), generator=g)
        for m in (graph, eager):
            m.forward(prompt, torch.tensor([0]), torch.tensor([slot]))
    for T in (1, 3, 5):
        slots = [3, 0, 2]
        tokens = torch.randint(0, 96, (3, T), generator=g)
        positions = torch.tensor([lengths[s] for s in slots])
        got = graph.forward(tokens, positions, torch.tensor(slots))
        for b, s in enumerate(slots):
            want = eager.forward(tokens[b : b + 1], positions[b : b + 1], torch.tensor([s]))
            torch.testing.assert_close(got[b : b + 1], want, rtol=1e-5, atol=1e-5)
        lengths = {s: lengths[s] + 1 for s in lengths}  # all but the first token rejected
    assert graph.stats.graph_calls == 3


@pytest.mark.parametrize("family", FAMILIES)
def test_static_path_trees_equal_eager(family_dir, family):
    """Token-tree verify calls on the static path (ancestor bits, RoPE by depth, per-layer windows measured from a
    node's depth, a row past the window) and `compact` equal the eager runner's tree attention; the same tokens fed
    as a chain give other logits (the tree mask is in force)."""
    from pipeline.models.graphs import GraphCausalLM, GraphConfig
    from tests.support.decode_attention_cases import compare_tree_calls

    path = family_dir(family)
    static = GraphConfig(graphs=False, compile=False, batch_buckets=(1, 2, 4), token_buckets=(1, 2, 4, 8), kv_block=16)
    models = {"static": GraphCausalLM(load_model(path)[0], static), "eager": load_model(path)[0]}
    err, argmax_equal, tree_effect = compare_tree_calls(torch, models, "static", ("eager",), vocab=96)
    assert err < 1e-4 and argmax_equal and tree_effect > 1e-2, (err, tree_effect)
    assert models["static"].stats.graph_calls >= 4


def test_config_parsing_of_the_families():
    from pipeline.models.llama import LlamaArgs, unsupported_reason

    base = dict(vocab_size=10, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, max_position_embeddings=8192)
    # Gemma 3 as its Hub config.json files say it (no layer_types, legacy RoPE keys): every 6th layer is global.
    legacy3 = LlamaArgs.from_hf({**base, "model_type": "gemma3_text", "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                 "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512,
                                 "sliding_window_pattern": 6, "query_pre_attn_scalar": 256})
    assert legacy3.sliding_layers == (True,) * 5 + (False,) and legacy3.window(0) == 512 and legacy3.window(5) is None
    assert legacy3.rope_theta == 1e6 and legacy3.rope_scaling["factor"] == 8.0 and legacy3.local_rope_theta == 1e4
    assert legacy3.local_rope(0) and not legacy3.local_rope(5)
    assert legacy3.head_dim == 256 and legacy3.tie_embeddings and legacy3.attn_softcap is None  # HF's defaults
    assert legacy3.activation == "gelu_pytorch_tanh" and legacy3.family.qk_norm
    # Gemma 2 without layer_types or caps in its config: alternating layers, HF's default caps.
    g2 = LlamaArgs.from_hf({**base, "model_type": "gemma2", "head_dim": 16})
    assert g2.sliding_layers == (True, False) * 3 and g2.window(0) == 4096
    assert (g2.attn_softcap, g2.final_softcap, g2.attn_scale) == (50.0, 30.0, 256**-0.5)
    q3 = LlamaArgs.from_hf({**base, "model_type": "qwen3", "head_dim": 16, "attention_bias": True})
    assert q3.qkv_bias and q3.o_bias and q3.family.qk_norm and q3.sliding_window is None
    assert "sliding" in unsupported_reason({**base, "model_type": "qwen3", "use_sliding_window": True})
    assert "bidirectional" in unsupported_reason({**base, "model_type": "gemma3_text",
                                                  "use_bidirectional_attention": True})
    assert "gemma" in unsupported_reason({**base, "model_type": "gemma"})  # Gemma 1: not a fast-path family
    assert "yarn" in unsupported_reason({**base, "model_type": "gemma3_text", "rope_parameters": {
        "full_attention": {"rope_type": "yarn", "factor": 4.0}, "sliding_attention": {"rope_type": "default"}}})


def test_tp2_equals_tp1(family_dir, tmp_path):
    """Two CPU ranks (gloo) against the single-process runner: logits to float32 summation order, the same greedy
    tokens; the static-shape TP path (uncaptured on CPU) too, for every family."""
    from tests.support.tp import MAX_LEN, SLOTS, script, spawn, wait_file

    paths = {family: str(family_dir(family)) for family in FAMILIES}
    procs = spawn(tp_rank, 2, paths, str(tmp_path))
    try:
        wait_file(tmp_path / "results.pt", 120, procs)
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    got = torch.load(tmp_path / "results.pt", weights_only=False)
    for family, path in paths.items():
        runner, _ = load_model(path)
        runner.allocate(SLOTS, MAX_LEN)
        want = script(runner, runner.info.vocab_size)
        for key in ("prefill_a", "prefill_b", "verify"):
            diff = (got[family][key] - want[key]).abs().max().item()
            assert diff < 1e-5, f"{family} {key}: max |TP2 - TP1| = {diff:.2e}"
        assert got[family]["greedy"].tolist() == want["greedy"].tolist(), family
        assert got[family]["num_parameters"] == runner.info.num_parameters
        assert not got[family]["graphs_refused"]
        assert got[family]["graphs"]["greedy"].tolist() == want["greedy"].tolist(), family
        assert (got[family]["graphs"]["verify"] - want["verify"]).abs().max() < 1e-5, family


def test_specserve_generate_says_which_runner_and_matches_hf(family_dir, tmp_path, capsys):
    """`specserve generate --target DIR --draft prompt-lookup --temperature 0` on a Gemma 2 folder (a word-level
    tokenizer added): one stderr line names the runner; the tokens run past the window and equal HF's greedy."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from specserve.cli import build_parser

    folder = tmp_path / "gemma2-tok"
    shutil.copytree(family_dir("gemma2"), folder)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w3"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w3", pad_token="w0").save_pretrained(folder)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 9, 5, 6, 7]
    args = build_parser().parse_args(["generate", "--prompt", " ".join(f"w{i}" for i in prompt), "--target",
                                      str(folder), "--draft", "prompt-lookup", "--temperature", "0",
                                      "--max-tokens", "24", "--json", "--max-seq-len", "64"])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    assert f"[target {folder.name}: fast path (model_type 'gemma2')]" in err.splitlines()
    want = hf_model(folder).generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):]
    assert json.loads(out)["token_ids"] == want.tolist()
