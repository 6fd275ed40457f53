"""A draft model of another tokenizer (pipeline.cross_tokenizer): conversions at the boundary, and exactness.

Both tokenizers are byte-level BPEs trained here, offline, on the repository's docs (a few hundred tokens each,
with different vocabularies), so words split differently; both models are tiny random Llamas.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pipeline.compat import IncompatibleDrafter
from pipeline.config import EngineConfig, SamplingParams, SpecParams
from pipeline.cross_tokenizer import CrossTokenizerDrafter, cross_tokenizer_problem
from pipeline.drafters import HybridDrafter, build_drafter
from pipeline.engine import SpeculativeEngine
from pipeline.models.loader import load_model
from pipeline.rejection import DraftBlock, accept, verify
from pipeline.sampling import SamplingTensors
from tests.pipeline.test_rejection import ALPHA, N, V, _pvalue
from tests.support.models import make_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2: the tiny models' pad, BOS and EOS


def _corpus() -> list[str]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [line for f in files for line in f.read_text(encoding="utf-8").splitlines()]


def train_tokenizer(vocab_size: int, lines: list[str]):
    """A byte-level BPE (GPT-2 style: every byte is a token, merges never cross a pre-token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target folder, draft folder): each a tiny random Llama with its own trained tokenizer."""
    root = tmp_path_factory.mktemp("xtok")
    lines = _corpus()
    folders = {}
    for name, vocab, hidden, layers, seed, part in (("target", 512, 64, 2, 0, lines),
                                                      ("draft", 384, 32, 1, 3, lines[::2])):
        tok = train_tokenizer(vocab, part)
        assert len(tok) == vocab
        folders[name] = make_tiny_llama(root / name, vocab_size=vocab, hidden=hidden, layers=layers,
                                        heads=4 if hidden == 64 else 2, kv_heads=2 if hidden == 64 else 1,
                                        max_position_embeddings=512, seed=seed)
        tok.save_pretrained(folders[name])
    return folders["target"], folders["draft"]


@pytest.fixture(scope="module")
def toks(pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(pair[0]), AutoTokenizer.from_pretrained(pair[1])


def _enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


class _Scripted:
    """A ModelDrafter stand-in at the unit seam: proposes the drafter ids it is given."""

    name = "scripted"
    model = None

    def __init__(self, ids: list[int]) -> None:
        self.ids, self.contexts = ids, []

    def admit(self, request_id, context) -> None:
        pass

    def release(self, request_id) -> None:
        pass

    def propose(self, rows, k, sampling, steps, draft_top_k) -> DraftBlock:
        self.contexts.append([list(r.context) for r in rows])
        ids = torch.tensor([self.ids[:k] + [0] * (k - len(self.ids[:k])) for _ in rows], dtype=torch.int64)
        return DraftBlock(ids, torch.tensor([r.num_draft for r in rows]))


def _propose(drafter: CrossTokenizerDrafter, context: list[int], num_draft: int = 6) -> list[int]:
    from pipeline.drafters import ProposeRow

    sampling = SamplingTensors.from_params([SamplingParams(seed=1)])
    block = drafter.propose([ProposeRow("r", context, num_draft)], num_draft, sampling,
                            torch.zeros(1, dtype=torch.int64), 8)
    n = int(block.num_draft[0])
    assert block.top_ids is not None and block.top_ids.shape[-1] == 1  # point masses
    assert torch.equal(block.top_ids[0, :n, 0], block.token_ids[0, :n])
    assert block.top_probs[0, :n, 0].eq(1).all() and block.top_probs[0, n:].eq(0).all()
    return block.token_ids[0, :n].tolist()


def _split_word(toks) -> str:
    """A word the target encodes as one token (after a space) and the drafter as several."""
    target_tok, draft_tok = toks
    words = sorted({w for line in _corpus() for w in line.split() if w.isalpha() and len(w) > 4})
    for w in words:
        if len(_enc(target_tok, " " + w)) == 1 and len(_enc(draft_tok, " " + w)) > 1:
            return w
    raise AssertionError("no word that the two tokenizers split differently")


def test_the_pair_really_differs_and_can_draft_through_text(toks):
    target_tok, draft_tok = toks
    assert target_tok.get_vocab() != draft_tok.get_vocab()
    assert cross_tokenizer_problem(target_tok, draft_tok) is None
    assert "no tokenizer files" in cross_tokenizer_problem(target_tok, None)


def test_a_word_split_differently_merges_as_the_target_encodes_it(toks):
    target_tok, draft_tok = toks
    word = _split_word(toks)
    prefix, follow = "The model", f" {word} and the target verify it."
    context = _enc(target_tok, prefix)
    script = _Scripted(_enc(draft_tok, follow))
    drafter = CrossTokenizerDrafter(script, target_tok, draft_tok, extra=0)
    got = _propose(drafter, context, num_draft=len(script.ids))
    whole = _enc(target_tok, prefix + follow)
    assert whole[: len(context)] == context
    assert got == whole[len(context) : -1][: len(script.ids)]  # the word is one target token; the last is held
    assert got[0] == _enc(target_tok, " " + word)[0]
    # The draft model read the context in its own tokens (with BOS where its tokenizer adds one).
    assert script.contexts[-1][0] == draft_tok(prefix)["input_ids"]


def test_a_word_continued_across_the_boundary_is_re_tokenized_from_its_start(toks):
    """The context ends inside a word ("...wor" + "d"): re-encoding from the word's start yields the target's
    own tokens for the context part, then the continuation; a draft whose merge changes them is cut."""
    target_tok, draft_tok = toks
    word = _split_word(toks)
    head, rest = word[:2], word[2:]
    context = _enc(target_tok, "The model " + head)  # " " + head: a token of its own, then rest continues it
    drafter = CrossTokenizerDrafter(_Scripted(_enc(draft_tok, rest + " is here and there")), target_tok, draft_tok)
    got = _propose(drafter, context)
    merged = _enc(target_tok, "The model " + word + " is here and there")
    if merged[: len(context)] == context:  # the target's encoding keeps " " + head as its own token
        assert got and got == merged[len(context) : -1][:6]
    else:  # the merged word is one token: the draft would not extend the context's tokens
        assert got == [] and drafter.cut_rows == 1


def test_a_draft_that_re_tokenizes_the_context_differently_is_cut(toks):
    target_tok, draft_tok = toks
    word = _split_word(toks)  # one target token after a space
    # The context spells the word's first letters as single-byte tokens, which the merged word would replace.
    context = _enc(target_tok, "The model") + [_enc(target_tok, c)[0] for c in " " + word[:2]]
    drafter = CrossTokenizerDrafter(_Scripted(_enc(draft_tok, word[2:] + " runs")), target_tok, draft_tok)
    assert _propose(drafter, context) == []
    assert drafter.cut_rows == 1


def test_bytes_of_one_character_spread_over_tokens(toks):
    """A character of several UTF-8 bytes: a draft ending inside it drops the partial character; a context
    ending inside it never re-tokenizes from within the character."""
    target_tok, draft_tok = toks
    char = "\u4e2d"  # three bytes, rare in the docs: a byte token each
    assert len(_enc(draft_tok, char)) > 1 and len(_enc(target_tok, char)) > 1
    context = _enc(target_tok, "The model")
    # The draft ends inside the character: it is dropped, and so is the last whole token (the space before it).
    drafter = CrossTokenizerDrafter(_Scripted(_enc(draft_tok, " and " + char)[:-1]), target_tok, draft_tok, extra=0)
    assert target_tok.decode(context + _propose(drafter, context, num_draft=8)) == "The model and"
    drafter = CrossTokenizerDrafter(_Scripted(_enc(draft_tok, " and " + char + " here")), target_tok, draft_tok)
    got = _propose(drafter, context, num_draft=20)
    assert got == _enc(target_tok, "The model and " + char + " here")[len(context) : -1]
    assert target_tok.decode(context + got).startswith("The model and " + char)
    # The context ends inside the character: its text stops before it, and no boundary lies inside it.
    partial = _enc(target_tok, "The model " + char)[:-1]
    drafter = CrossTokenizerDrafter(_Scripted(_enc(draft_tok, " runs here")), target_tok, draft_tok)
    row = drafter._row("p", partial)
    assert row.target.text in ("The model", "The model ")
    assert _propose(drafter, partial) == []  # the bytes pending in the context cannot be re-encoded from text


def test_whitespace_runs_and_newlines(toks):
    target_tok, draft_tok = toks
    prefix, follow = "def f(x):\n", "    return x  +  1\n\n# done here"
    context = _enc(target_tok, prefix)
    drafter = CrossTokenizerDrafter(_Scripted(_enc(draft_tok, follow)), target_tok, draft_tok)
    got = _propose(drafter, context, num_draft=40)
    whole = _enc(target_tok, prefix + follow)
    assert whole[: len(context)] == context and got == whole[len(context) : -1]


def test_the_drafters_eos_ends_the_draft(toks):
    target_tok, draft_tok = toks
    ids = _enc(draft_tok, " and the model") + [draft_tok.eos_token_id] + _enc(draft_tok, " more words")
    drafter = CrossTokenizerDrafter(_Scripted(ids), target_tok, draft_tok)
    context = _enc(target_tok, "Here")
    got = _propose(drafter, context, num_draft=20)
    # the text up to the drafter's EOS, re-encoded, less its last token (a later character could still change it):
    # which tokens those are depends on the BPE vocabulary the fixture trained, so the test asks for them, not a text
    whole = _enc(target_tok, "Here and the model")
    assert whole[: len(context)] == context and got == whole[len(context) : -1]
    assert "more" not in target_tok.decode(context + got)


def test_the_context_is_kept_incrementally(toks):
    """The drafter's ids of a stable prefix are kept; only the tail is re-encoded, with the same result."""
    target_tok, draft_tok = toks
    text = " ".join(_corpus()[:40])[:1500]
    full = _enc(target_tok, text)
    drafter = CrossTokenizerDrafter(_Scripted([]), target_tok, draft_tok)
    for n in range(5, len(full), 7):
        row = drafter._row("r", full[:n])
        assert row.target.text == target_tok.decode(full[:n])[: len(row.target.text)]
        assert draft_tok.decode(row.draft_ctx, skip_special_tokens=True) == row.target.text
    assert row.draft.anchor > len(row.target.text) // 2  # most of the context is not re-encoded
    assert row.draft_ctx == draft_tok(row.target.text)["input_ids"]


def test_build_drafter_wraps_another_vocabulary_and_refuses_what_cannot_work(pair, toks, caplog):
    target, draft = pair
    t_model, t_tok = load_model(target)
    with caplog.at_level("INFO", logger="pipeline.drafters"):
        drafter = build_drafter(str(draft), t_model.info, t_tok)
    assert isinstance(drafter, CrossTokenizerDrafter)
    assert "drafting through text" in caplog.text
    hybrid = build_drafter(f"lookup+{draft}", t_model.info, t_tok)
    assert isinstance(hybrid, HybridDrafter) and isinstance(hybrid.model, CrossTokenizerDrafter)
    with pytest.raises(IncompatibleDrafter, match="cannot draft through text either: the target has no tokenizer"):
        build_drafter(str(draft), t_model.info, None)
    no_tok = draft.parent / "draft-no-tokenizer"
    shutil.copytree(draft, no_tok)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (no_tok / f).unlink(missing_ok=True)
    with pytest.raises(IncompatibleDrafter, match="the draft model has no tokenizer files"):
        build_drafter(str(no_tok), t_model.info, t_tok)


@pytest.mark.parametrize("draft_word", ["MODEL", "lookup+MODEL"])
def test_greedy_equals_the_targets_greedy_token_for_token(pair, draft_word):
    target, draft = pair
    config = EngineConfig(max_batch_size=2, max_seq_len=256)
    plain = SpeculativeEngine.from_pretrained(str(target), None, config)
    spec = SpeculativeEngine.from_pretrained(str(target), draft_word.replace("MODEL", str(draft)), config)
    assert isinstance(spec.drafter, (CrossTokenizerDrafter, HybridDrafter))
    prompts = ["The target verifies what the drafter proposes, and the drafter",
               "def step(batch):\n    return verify(batch)  # caf\u00e9"]
    prompts = prompts if draft_word == "MODEL" else prompts[:1]  # a batch of two rows once is enough
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = plain.generate_batch(prompts, params)
    got = spec.generate_batch(prompts, params, SpecParams(num_draft_tokens=4))
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert g.stats["drafted"] > 0  # it did speculate


def test_sampled_rows_replay_and_stay_exact_in_form(pair):
    """At T=0.7 a seeded request replays identically with the cross-tokenizer drafter."""
    target, draft = pair
    engine = SpeculativeEngine.from_pretrained(str(target), str(draft), EngineConfig(max_batch_size=2,
                                                                                     max_seq_len=256))
    params = SamplingParams(temperature=0.7, seed=11, max_tokens=12, ignore_eos=True)
    first = engine.generate("The drafter proposes", params, SpecParams(num_draft_tokens=3))
    again = engine.generate("The drafter proposes", params, SpecParams(num_draft_tokens=3))
    assert first.token_ids == again.token_ids and len(first.token_ids) == 12


class _Oracle(_Scripted):
    """A draft model that knows the text the target will write: it proposes that text's continuation after its
    context, in the drafter's tokens."""

    def __init__(self, draft_tok, text: str) -> None:
        super().__init__([])
        self.draft_tok, self.text = draft_tok, text

    def propose(self, rows, k, sampling, steps, draft_top_k) -> DraftBlock:
        out = []
        for r in rows:
            seen = self.draft_tok.decode(list(r.context), skip_special_tokens=True)
            ids = _enc(self.draft_tok, self.text[len(seen):]) if self.text.startswith(seen) else []
            out.append(ids[:k] + [0] * (k - len(ids[:k])))
        return DraftBlock(torch.tensor(out, dtype=torch.int64), torch.tensor([r.num_draft for r in rows]))


def test_drafts_of_the_targets_own_text_are_accepted_token_for_token(pair, toks):
    """With a drafter that proposes the target's own greedy text, the conversions put it back into the target's
    tokens: drafts are accepted, and the output is still the target's, token for token."""
    target, _ = pair
    target_tok, draft_tok = toks
    model, _ = load_model(target)
    config = EngineConfig(max_batch_size=1, max_seq_len=256)
    prompt = "The target verifies what the drafter proposes, and"
    params = SamplingParams(max_tokens=24)
    want = SpeculativeEngine(model, target_tok, None, config).generate(prompt, params)
    oracle = _Oracle(draft_tok, target_tok.decode(_enc(target_tok, prompt) + want.token_ids, skip_special_tokens=True))
    engine = SpeculativeEngine(model, target_tok, CrossTokenizerDrafter(oracle, target_tok, draft_tok), config)
    got = engine.generate(prompt, params, SpecParams(num_draft_tokens=4))
    assert got.token_ids == want.token_ids
    assert got.stats["accepted"] > 0, got.stats


def _point_mass_passes(target_probs: torch.Tensor, draft_probs: torch.Tensor, n: int, claimed: str):
    """n seeded passes at T=0.7 of drafts shaped as the cross-tokenizer drafter ships them: the draft token
    drawn by a drafter (independently of the target's randomness), claimed as a point mass ("point"), or, as a
    broken drafter would, with the probability it had under its own distribution ("own")."""
    K = draft_probs.shape[0]
    seeds = torch.arange(n, dtype=torch.int64) * 104729 + 7
    steps = torch.full((n,), 2, dtype=torch.int64)
    sampling = SamplingTensors.from_params([SamplingParams(temperature=0.7, seed=int(s)) for s in seeds])
    g = torch.Generator().manual_seed(5)
    tokens = torch.multinomial(draft_probs, n, replacement=True, generator=g).T.contiguous()  # [n, K]
    probs = torch.ones(n, K, 1) if claimed == "point" else draft_probs.gather(-1, tokens.T).T[..., None]
    draft = DraftBlock(tokens, torch.full((n,), K), tokens[..., None].clone(), probs)
    logits = target_probs.log().expand(n, K + 1, V) * 0.7  # warp(logits / 0.7) == target_probs
    out = accept(verify(logits, draft, sampling, steps), draft, seeds, steps)
    return out.tokens, out.num_accepted


@pytest.mark.parametrize("claimed", ["point", "own"])
def test_point_mass_drafts_follow_the_target_at_t07_and_a_wrong_claim_does_not(claimed):
    K = 2
    g = torch.Generator().manual_seed(3)
    target = torch.softmax(torch.randn(K + 1, V, generator=g) * 1.5, -1)
    draft = torch.softmax(torch.randn(K, V, generator=g) * 1.5, -1)
    tokens, num_accepted = _point_mass_passes(target, draft, N, claimed)
    pvalues = [_pvalue(tokens[num_accepted >= i, i], target[i]) for i in range(K + 1)]
    if claimed == "point":
        assert min(pvalues) > ALPHA, f"point-mass drafts deviate from the target: {pvalues}"
        assert 0.05 < num_accepted.float().mean() / K < 0.95
    else:
        assert min(pvalues) < 1e-6, f"a drafter claiming its own probabilities passed: {pvalues}"


def test_a_serve_drafter_worker_drafts_through_text(pair, toks):
    """The drafter replica's worker (constructed here without Ray; `_run_batch` is its batch, run inline) wraps a
    draft model of another tokenizer and answers in the target's tokens, as point masses."""
    from deployments.drafter_replica import DrafterWorker
    from deployments.messages import ProposeCall

    target, draft = pair
    target_tok, _ = toks
    worker = DrafterWorker(str(draft), max_batch_size=2, max_seq_len=256, target=str(target))
    assert isinstance(worker.drafter, CrossTokenizerDrafter)
    context = _enc(target_tok, "The drafter proposes and the target verifies")
    params = SamplingParams(seed=3)
    [got] = worker._run_batch([ProposeCall("r", 0, context, 4, params, 0, 8)])
    assert len(got.tokens) <= 4 and all(0 <= t < len(target_tok) for t in got.tokens)
    assert got.top_probs is None or (got.top_probs[:, 0] == 1).all()
    plain = DrafterWorker(str(draft), max_batch_size=2, max_seq_len=256, target=str(draft))  # same tokenizer
    assert not isinstance(plain.drafter, CrossTokenizerDrafter)
