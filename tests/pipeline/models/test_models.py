"""Model runners against HF transformers: prefill, ragged incremental decoding, rollback; loader; store."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.models import store
from pipeline.models.base import CausalLM
from pipeline.models.loader import load_model
from tests.support import ROOT
from tests.support.models import make_tiny_gpt2, make_tiny_llama

transformers = pytest.importorskip("transformers")

TOL = 1e-4  # float32 max abs logits difference against HF
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

# name -> make_tiny_llama kwargs: GQA and not, tied and untied, biases (qwen2), llama3 RoPE, sliding window.
TINY_CONFIGS = {
    "llama-gqa-untied": dict(arch="llama", heads=4, kv_heads=2, tie=False),
    "llama-mha-tied-llama3rope": dict(arch="llama", heads=4, kv_heads=4, tie=True, rope_scaling=LLAMA3_ROPE),
    "llama-mqa-3layers": dict(arch="llama", hidden=48, heads=6, kv_heads=1, layers=3, vocab_size=97),
    "qwen2-gqa-tied": dict(arch="qwen2", heads=4, kv_heads=2, tie=True),
    "qwen2-mha-untied": dict(arch="qwen2", heads=2, kv_heads=2, hidden=32),
    "mistral-gqa": dict(arch="mistral", heads=4, kv_heads=2),
    "mistral-window6": dict(arch="mistral", heads=4, kv_heads=1, sliding_window=6),
}


@pytest.fixture(scope="module", autouse=True)
def _threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            if name == "gpt2":
                made[name] = make_tiny_gpt2(root / name)
            else:
                made[name] = make_tiny_llama(root / name, seed=len(made), **TINY_CONFIGS[name])
        return made[name]

    return get


def hf_logits(hf_model, seq: list[int]) -> torch.Tensor:  # [T, V] float32 on CPU, fresh run, no cache
    with torch.no_grad():
        return hf_model(torch.tensor([seq], device=hf_model.device)).logits[0].float().cpu()


def check_against_hf(runner: CausalLM, hf_model, vocab: int, seed: int = 0) -> float:
    """Drive `runner` through a ragged prefill, ragged multi-token decode steps and a rollback; return
    the largest logits difference to fresh HF runs of the same sequences."""
    g = torch.Generator().manual_seed(seed)
    runner.allocate(num_slots=5, max_len=48)

    def forward(*args, **kwargs) -> torch.Tensor:  # the runner's logits, on the CPU (runner may be on GPU)
        return runner.forward(*args, **kwargs).cpu()

    slots = torch.tensor([3, 0, 4])  # not in order, not contiguous
    lengths = [9, 4, 13]  # prompt lengths
    seqs = [torch.randint(0, vocab, (40,), generator=g).tolist() for _ in lengths]
    worst = 0.0

    def compare(out: torch.Tensor, b: int, start: int, n: int) -> None:  # out[b, :n] vs HF at start..
        nonlocal worst
        ref = hf_logits(hf_model, seqs[b][: start + n])[start:]
        worst = max(worst, (out[b, :n] - ref).abs().max().item())

    # 1. Ragged prefill: all rows start at 0, right-padded to the longest prompt with junk ids.
    T = max(lengths)
    tokens = torch.tensor([s[:n] + [vocab - 1] * (T - n) for s, n in zip(seqs, lengths)])
    out = forward(tokens, torch.zeros(3, dtype=torch.long), slots)
    assert out.shape == (3, T, vocab) and out.dtype == torch.float32
    for b, n in enumerate(lengths):
        compare(out, b, 0, n)
    # logits_from: only the last rows
    last = forward(tokens, torch.zeros(3, dtype=torch.long), slots, logits_from=T - 1)
    assert last.shape == (3, 1, vocab)
    assert torch.allclose(last[:, 0], out[:, -1], atol=1e-5)

    # 2. Ragged decode steps: rows at different positions, 1..4 tokens per step, rows in shuffled order.
    pos = list(lengths)
    for step, k in enumerate([1, 3, 4, 2, 1]):
        order = [(step + i) % 3 for i in range(3)]
        batch = torch.tensor([seqs[b][pos[b] : pos[b] + k] for b in order])
        out = forward(batch, torch.tensor([pos[b] for b in order]), slots[order])
        for row, b in enumerate(order):
            ref = hf_logits(hf_model, seqs[b][: pos[b] + k])[pos[b] :]
            worst = max(worst, (out[row] - ref).abs().max().item())
            pos[b] += k

    # 3. Rollback: rows go back to earlier positions and feed other tokens; a sub-batch of two rows.
    rows = [0, 2]
    back = [pos[0] - 3, pos[2] - 5]
    new = [torch.randint(0, vocab, (4,), generator=g).tolist() for _ in rows]
    out = forward(torch.tensor(new), torch.tensor(back), slots[rows])
    for row, (b, p, toks) in enumerate(zip(rows, back, new)):
        seqs[b] = seqs[b][:p] + toks + seqs[b][p + 4 :]
        ref = hf_logits(hf_model, seqs[b][: p + 4])[p:]
        worst = max(worst, (out[row] - ref).abs().max().item())
        pos[b] = p + 4
    # ...and then continue decoding all rows after the rollback.
    out = forward(torch.tensor([seqs[b][pos[b] : pos[b] + 2] for b in range(3)]), torch.tensor(pos), slots)
    for b in range(3):
        compare(out, b, pos[b], 2)
    return worst


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_llama_fast_path_matches_hf(tiny_dir, name):
    path = tiny_dir(name)
    runner, tokenizer = load_model(str(path))
    assert tokenizer is None
    assert runner.info.fast_path, f"{name} should run on the fast path"
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert runner.info.num_parameters == sum(p.numel() for p in hf.parameters())
    assert runner.info.vocab_size == hf.config.vocab_size
    assert runner.info.eos_token_ids == (2,)
    diff = check_against_hf(runner, hf, hf.config.vocab_size)
    print(f"{name}: max |logits - HF| = {diff:.2e}")
    assert diff < TOL, f"{name}: max abs logits diff {diff:.3g} >= {TOL}"


def test_sliding_window_is_active(tiny_dir):
    """The mistral window config must differ from full attention past the window (else the test above
    would not test the window at all)."""
    path = tiny_dir("mistral-window6")
    windowed, _ = load_model(str(path))
    cfg = json.loads((path / "config.json").read_text())
    full_dir = path.parent / "mistral-nowindow"
    shutil.copytree(path, full_dir, dirs_exist_ok=True)
    (full_dir / "config.json").write_text(json.dumps({**cfg, "sliding_window": None}))
    full, _ = load_model(str(full_dir))
    tokens = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    outs = []
    for r in (windowed, full):
        r.allocate(1, 16)
        outs.append(r.forward(tokens, torch.tensor([0]), torch.tensor([0])))
    assert torch.allclose(outs[0][:, :6], outs[1][:, :6], atol=1e-5)  # window not reached yet
    assert (outs[0][:, 6:] - outs[1][:, 6:]).abs().max() > 1e-2


def test_bfloat16_close_to_hf(tiny_dir):
    path = tiny_dir("llama-gqa-untied")
    runner, _ = load_model(str(path), dtype="bfloat16")
    assert runner.model.tok_embeddings.weight.dtype == torch.bfloat16
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    runner.allocate(2, 32)
    tokens = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(2))
    out = runner.forward(tokens, torch.tensor([0, 0]), torch.tensor([1, 0]))
    assert out.dtype == torch.float32
    with torch.no_grad():
        ref = hf(tokens).logits.float()
    diff = (out - ref).abs().max().item()
    print(f"bf16: max |logits - HF bf16| = {diff:.2e} (logits scale {ref.abs().max():.1f})")
    assert diff < 0.1


def test_generic_runner_matches_hf(tiny_dir):
    path = tiny_dir("gpt2")
    with pytest.warns(UserWarning, match="generic"):
        import pipeline.models.hf_generic as hf_generic

        hf_generic._warned = False
        runner, _ = load_model(str(path))
    assert not runner.info.fast_path and runner.info.architecture == "GPT2LMHeadModel"
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    diff = check_against_hf(runner, hf, hf.config.vocab_size)
    print(f"gpt2 generic: max |logits - HF| = {diff:.2e}")
    assert diff < TOL


def test_unsupported_llama_config_falls_back_to_generic(tiny_dir, tmp_path):
    src = tiny_dir("llama-gqa-untied")
    dst = tmp_path / "linear-rope"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    (dst / "config.json").write_text(json.dumps(cfg))
    runner, _ = load_model(str(dst))
    assert not runner.info.fast_path
    hf = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    runner.allocate(1, 16)
    tokens = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(3))
    out = runner.forward(tokens, torch.tensor([0]), torch.tensor([0]))
    assert (out[0] - hf_logits(hf, tokens[0].tolist())).abs().max() < TOL


def test_config_parsing_legacy_and_v5_keys():
    from pipeline.models.llama import LlamaArgs, unsupported_reason

    base = dict(model_type="llama", vocab_size=10, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                intermediate_size=128, max_position_embeddings=8192)
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    legacy = LlamaArgs.from_hf({**base, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **llama3}})
    v5 = LlamaArgs.from_hf({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **llama3}})
    assert legacy == v5 and v5.rope_theta == 500000.0 and v5.rope_scaling["factor"] == 8.0
    assert v5.n_kv_heads == 4 and v5.head_dim == 16 and not v5.tie_embeddings
    assert LlamaArgs.from_hf({**base, "rope_theta": 1e6}).rope_scaling is None
    assert "linear" in unsupported_reason({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert "gelu" in unsupported_reason({**base, "hidden_act": "gelu"})
    assert "sliding" in unsupported_reason({**base, "model_type": "qwen2", "use_sliding_window": True})
    assert unsupported_reason({**base, "model_type": "gpt2"}) is not None
    qwen = LlamaArgs.from_hf({**base, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False})
    assert qwen.qkv_bias and not qwen.o_bias and qwen.sliding_window is None


def test_runner_guards(tiny_dir):
    runner, _ = load_model(str(tiny_dir("llama-gqa-untied")))
    with pytest.raises(AssertionError, match="allocate"):
        runner.forward(torch.zeros(1, 2, dtype=torch.long), torch.tensor([0]), torch.tensor([0]))
    runner.allocate(2, 8)
    assert (runner.num_slots, runner.max_len) == (2, 8)
    with pytest.raises(AssertionError, match="exceeds max_len"):
        runner.forward(torch.zeros(1, 3, dtype=torch.long), torch.tensor([6]), torch.tensor([0]))


def test_loader_errors(tmp_path):
    with pytest.raises(ValueError, match="model path not found"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"not a model folder \(no config.json\)"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="no weights"):
        load_model(str(tmp_path))
    bad = tmp_path / "weights.txt"
    bad.write_text("x")
    with pytest.raises(ValueError, match="unsupported model file"):
        load_model(str(bad))
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(str(tmp_path), dtype="float8")


def test_pipeline_models_import_no_serving_deps():
    code = (
        "import sys, pipeline.models.loader, pipeline.models.llama, pipeline.models.hf_generic, "
        "pipeline.models.store, tests.support.models\n"
        "bad = [m for m in ('ray', 'redis', 'fastapi', 'opentelemetry', 'deployments') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.slow
def test_demo_model_fast_path_matches_hf():
    folder = store.resolve(None)  # first time: download + convert (~30 s)
    assert folder == store.resolve(store.DEMO_TARGET)
    assert (folder / "config.json").exists() and any(folder.glob("*.safetensors"))
    t0 = time.perf_counter()
    load_model(None)  # the first load in a process also pays transformers' lazy imports
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    runner, tokenizer = load_model(None)
    load_s = time.perf_counter() - t0
    print(f"demo load: first in process {first_s:.2f} s, second {load_s:.2f} s")  # a figure, not a test: no bound
    info = runner.info
    assert info.fast_path and info.architecture == "LlamaForCausalLM" and info.name == store.DEMO_TARGET
    assert info.vocab_size == 49152 and 2 in info.eos_token_ids
    assert 130e6 < info.num_parameters < 140e6
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    ids = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = hf_logits(hf, list(ids))
    runner.allocate(2, 64)
    out = runner.forward(torch.tensor([ids]), torch.tensor([0]), torch.tensor([1]))[0]
    diff = (out - ref).abs().max().item()
    print(f"demo: max |logits - HF| = {diff:.2e} over {len(ids)} tokens (logits scale {ref.abs().max():.1f})")
    assert diff < 1e-3
    # Greedy continuation from the cache equals HF's greedy argmax, and says something about Paris.
    seq, nxt = list(ids), int(out[-1].argmax())
    for _ in range(6):
        seq.append(nxt)
        logits = runner.forward(torch.tensor([[nxt]]), torch.tensor([len(seq) - 1]), torch.tensor([1]))
        nxt = int(logits[0, -1].argmax())
    hf_out = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids) :].tolist()
    assert seq[len(ids) :] == hf_out
    assert "Paris" in tokenizer.decode(hf_out)
