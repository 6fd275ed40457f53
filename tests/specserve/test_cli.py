"""`specserve generate` as a user runs it: real subprocesses, real exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline.compat import IncompatibleDrafter, check_compatible
from pipeline.models.loader import load_model
from pipeline.models.store import DEMO_DRAFT, SHIPPED_DRAFTERS, resolve
from tests.support.models import make_tiny_llama


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specserve", *args], capture_output=True, text=True, timeout=timeout)


def _assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one error line, got:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


@pytest.mark.parametrize(
    "args,needles",
    [
        (["-k", "0"], ["-k must be >= 1"]),
        (["--temperature", "-1"], ["temperature must be >= 0"]),
        (["--top-p", "0"], ["top_p must be in (0, 1]"]),
        (["--top-p", "1.5"], ["top_p must be in (0, 1]"]),
        (["--max-tokens", "0"], ["max_tokens must be >= 1"]),
        (["--target", "/nonexistent/model"], ["not found", "/nonexistent/model"]),
        (["--temperature", "warm"], ["invalid float value"]),
        (["--tree-dynamic"], ["need --tree"]),
        (["--tree", "4,4", "--tree-dynamic"], ["dynamic tree needs a node budget"]),
        (["--tree", "/nonexistent/tree.json"], ["tree file not found", "/nonexistent/tree.json"]),
        (["--tree", "/nonexistent/tree.json", "--tree-nodes", "4"], ["takes no --tree-nodes"]),
    ],
)
def test_bad_input_exits_with_one_line(args, needles):
    _assert_one_line_error(_cli("generate", "--prompt", "hi", *args), *needles)


def test_non_model_folder_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    _assert_one_line_error(_cli("generate", "--prompt", "hi", "--target", str(tmp_path)), "config.json")


def test_mismatched_vocabularies_are_refused_naming_both_sizes(tmp_path):
    target = make_tiny_llama(tmp_path / "t", vocab_size=128)
    draft = make_tiny_llama(tmp_path / "d", vocab_size=96)
    t_model, _ = load_model(target)
    d_model, _ = load_model(draft)
    with pytest.raises(IncompatibleDrafter, match=r"draft .* has 96 tokens, target .* has 128"):
        check_compatible(t_model.info, None, d_model.info, None)
    check_compatible(t_model.info, None, t_model.info, None)  # same vocabulary: fine
    proc = _cli("generate", "--prompt", "hi", "--target", str(target), "--draft", str(draft))
    _assert_one_line_error(proc, "96", "128")


def test_fp8_draft_weights_are_refused_where_they_cannot_apply(tmp_path):
    """--draft-weights fp8 needs a draft model on CUDA: on the CPU, or with prompt lookup, one line and exit 1
    (generate and bench)."""
    target = make_tiny_llama(tmp_path / "t", vocab_size=128)
    draft = make_tiny_llama(tmp_path / "d", vocab_size=128, hidden=32, layers=1, heads=2, kv_heads=1)
    base = ("generate", "--prompt", "hi", "--target", str(target), "--draft-weights", "fp8")
    _assert_one_line_error(_cli(*base, "--draft", str(draft)), "needs the draft model on a CUDA device")
    _assert_one_line_error(_cli(*base, "--draft", "prompt-lookup"), "applies to a draft model")
    prompts = tmp_path / "prompts.jsonl"  # its own prompts: the default file may not be beside this checkout
    prompts.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Say hi."]}) + "\n")
    bench = ("bench", "--target", str(target), "--draft-weights", "fp8", "--methods", "engine-spec",
             "--per-category", "1", "--prompts", str(prompts), "--out", str(tmp_path / "b"), "--no-progress")
    _assert_one_line_error(_cli(*bench, "--draft", str(draft)), "needs the draft model on a CUDA device")


@pytest.mark.slow
def test_generate_json_on_the_demo_model(demo_path):
    proc = _cli("generate", "--prompt", "Name a colour.", "--chat", "--max-tokens", "12", "--json",
                "--draft", "prompt-lookup", "--temperature", "0.8", "--seed", "7")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"token_ids", "text", "stats", "seed"} and out["seed"] == 7
    assert 1 <= len(out["token_ids"]) <= 12 and out["stats"]["generated"] == len(out["token_ids"])
    again = json.loads(_cli("generate", "--prompt", "Name a colour.", "--chat", "--max-tokens", "12", "--json",
                            "--draft", "prompt-lookup", "--temperature", "0.8", "--seed", "7").stdout)
    assert again["token_ids"] == out["token_ids"], "same seed, same tokens"


@pytest.mark.slow
def test_generate_streams_text(demo_path):
    proc = _cli("generate", "--prompt", "Say hello.", "--chat", "--max-tokens", "8", "--no-draft")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), "no text streamed"
    assert "tok/s" in proc.stderr


def test_shipped_drafter_is_addressable_by_name():
    assert resolve(DEMO_DRAFT) == SHIPPED_DRAFTERS / DEMO_DRAFT
    with pytest.raises(ValueError, match="not found"):
        resolve("no-such-drafter")
