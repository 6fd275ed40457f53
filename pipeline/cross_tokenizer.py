"""Drafting with a model of another tokenizer, through text (Hugging Face's "universal assisted generation").

`CrossTokenizerDrafter` wraps a `ModelDrafter` whose vocabulary differs from the target's. Per propose, per row:

1. Target to draft: the target context is decoded to text, incrementally (`_TargetText` decodes each new token
   once, over a small window, and records where each token's text ends), and encoded with the drafter's tokenizer.
   The drafter ids of a stable prefix are kept (`_DraftIds`): only the text after an anchor is re-encoded, and the
   anchor moves to the start of a drafter token `margin` tokens before the end once decoding those ids gives back
   the text exactly. The draft model's own KV cache keeps the longest prefix that still matches.
2. The draft model proposes K' = num_draft + `extra` tokens in its own vocabulary.
3. Draft to target: the proposed ids are cut at the first special token (EOS) and decoded to text together with a
   few context ids before them (so a leading space decodes right); a trailing incomplete character is dropped.
   The target context is re-tokenized from a stable boundary: the start of the last target token whose text
   begins with whitespace (a pre-tokenizer split), at most `lookback` tokens back, never across a special token
   nor inside a character whose bytes span tokens. The text from there plus the draft text is encoded with the
   target's tokenizer, so a word split across the boundary merges as the target's tokenizer merges it. The
   encoding must start with the context's own tokens after the boundary; where it does not, the draft does not
   extend the context's exact tokens and the row drafts nothing this step (cut). Of the tokens after the
   context's, the last is dropped (more text could re-tokenize it differently) and the rest are capped at
   num_draft.

Exactness: the drafts are shipped as point masses (`top_ids` = the token, probability 1): the drafter's
probabilities are over another vocabulary and are not used. Rejection sampling with a point-mass draft d accepts
d with probability min(1, target_probs(d) / 1) and otherwise draws the recovered token from target_probs with d
removed and renormalised, so each emitted token has exactly the target's distribution, whatever d is, as long
as d does not depend on the target's accept or recovery randomness (the draft model samples from its own stream,
`Stream.DRAFT`). Output is therefore exact at any temperature, greedy output equals the target's greedy output
token for token, and a seeded request replays identically; the text conversions only change what is accepted.

Where it cannot work, `cross_tokenizer_problem` says why (a model without tokenizer files, a tokenizer that does
not decode its own encoding back to the same text, or a target tokenizer that encodes text after a word boundary
unlike the same text in context, as prefix-space SentencePiece tokenizers do).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from pipeline.drafters import ModelDrafter, ProposeRow, _as_list, _padded
from pipeline.rejection import DraftBlock
from pipeline.sampling import SamplingTensors

_PROBE = "Hello world, hello  there.\n\tdef f(x): return x + 1  # 42 caf\u00e9 \u4e2d\u6587!"
_PROBE_HEAD, _PROBE_TAIL = "The quick brown fox", " jumps over the lazy dog."


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def _specials(tokenizer: Any) -> frozenset[int]:
    return frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ())


def same_vocabulary(target_tok: Any | None, draft_tok: Any | None) -> bool:
    """Whether both tokenizers map every token to the same id (then a drafter needs no text conversion)."""
    return target_tok is not None and draft_tok is not None and target_tok.get_vocab() == draft_tok.get_vocab()


def cross_tokenizer_problem(target_tok: Any | None, draft_tok: Any | None) -> str | None:
    """Why drafting through text cannot work for this pair, in one line; None when it can."""
    for role, tok in (("target", target_tok), ("draft model", draft_tok)):
        if tok is None:
            return f"the {role} has no tokenizer files, so its tokens cannot be turned into text"
        if _decode(tok, _encode(tok, _PROBE)) != _PROBE:
            return f"the {role}'s tokenizer does not decode its own encoding back to the same text (it normalises)"
    if _encode(target_tok, _PROBE_HEAD + _PROBE_TAIL) != _encode(target_tok, _PROBE_HEAD) + _encode(target_tok,
                                                                                                   _PROBE_TAIL):
        return ("the target's tokenizer encodes text after a word boundary unlike the same text in context "
                "(a prefix-space tokenizer), so drafts cannot be re-encoded from a boundary")
    return None


class _TargetText:
    """The target context as text, decoded one token at a time (the window of `IncrementalDetokenizer`).
    ends[i]: length of the text once token i is decoded; clean[i]: the text through token i is exact (token i
    completed every character it began, or it is a special token, which decodes to nothing)."""

    def __init__(self, tokenizer: Any, specials: frozenset[int]) -> None:
        self.tokenizer, self.specials = tokenizer, specials
        self.ids: list[int] = []
        self.text = ""
        self.ends: list[int] = []
        self.clean: list[bool] = []
        self._prefix = self._read = 0  # decode window: ids[_prefix:_read] is the last decoded group

    def extends(self, context: list[int]) -> bool:
        return context[: len(self.ids)] == self.ids

    def push(self, token: int) -> None:
        self.ids.append(token)
        if token in self.specials:
            self._prefix = self._read = len(self.ids)  # the next token decodes on its own
            clean = True
        else:
            before = _decode(self.tokenizer, self.ids[self._prefix : self._read])
            full = _decode(self.tokenizer, self.ids[self._prefix :])
            clean = len(full) > len(before) and not full.endswith("\ufffd") and full.startswith(before)
            if clean:
                self.text += full[len(before) :]
                self._prefix, self._read = self._read, len(self.ids)
        self.ends.append(len(self.text))
        self.clean.append(clean)

    def boundary(self, lookback: int) -> int | None:
        """The token index j to re-tokenize from (tokens j.. and the text from `start(j)`), or None."""
        n = len(self.ids)
        fallback = None
        for j in range(n - 1, max(n - lookback, 0) - 1, -1):
            if self.ids[j] in self.specials:
                break  # never re-encode across a special token
            if j > 0 and not self.clean[j - 1]:
                continue  # inside a character whose bytes span tokens
            start = self.start(j)
            if j == 0 or self.text[start : start + 1].isspace():
                return j
            fallback = j  # the lowest clean one, if no word starts within reach
        return fallback

    def start(self, j: int) -> int:
        return self.ends[j - 1] if j > 0 else 0


class _DraftIds:
    """The drafter's ids for the target text: ids of text[:anchor] kept, the rest re-encoded each time."""

    def __init__(self, tokenizer: Any, bos: list[int], margin: int) -> None:
        self.tokenizer, self.bos, self.margin = tokenizer, bos, margin
        self.anchor = 0
        self.ids: list[int] = []

    def encode(self, text: str) -> list[int]:
        rest = text[self.anchor :]
        tail = _encode(self.tokenizer, rest) if rest else []
        out = self.bos + self.ids + tail
        if len(tail) > self.margin:  # move the anchor where the kept ids give back the text exactly
            head = tail[: len(tail) - self.margin]
            head_text = _decode(self.tokenizer, head)
            if head_text and rest.startswith(head_text) and _encode(self.tokenizer, head_text) == head:
                self.ids += head
                self.anchor += len(head_text)
        return out


@dataclass
class _Row:
    target: _TargetText
    draft: _DraftIds
    draft_ctx: list[int] = field(default_factory=list)  # the drafter ids of the last propose's context


class CrossTokenizerDrafter:
    """A draft model of another vocabulary: context and drafts pass through text (the module docstring says how,
    and why the output stays exact)."""

    def __init__(
        self,
        drafter: ModelDrafter,
        target_tokenizer: Any,
        draft_tokenizer: Any,
        extra: int = 2,  # draft tokens asked beyond num_draft (the last target token is dropped; words differ)
        lookback: int = 8,  # target tokens the boundary may lie back
        margin: int = 4,  # drafter tokens re-encoded each time at the end of the context
    ) -> None:
        self.drafter, self.target_tok, self.draft_tok = drafter, target_tokenizer, draft_tokenizer
        self.name = drafter.name
        self.extra, self.lookback, self.margin = extra, lookback, margin
        self._target_specials, self._draft_specials = _specials(target_tokenizer), _specials(draft_tokenizer)
        with_bos = list(draft_tokenizer("", add_special_tokens=True)["input_ids"])
        self._bos = [t for t in with_bos if t in self._draft_specials][:1]  # the drafter's BOS, if it adds one
        self._rows: dict[str, _Row] = {}
        self.cut_rows = 0  # drafts cut because their re-encoding disagreed with the context (stats, tests)

    @property
    def model(self):
        return self.drafter.model

    @property
    def device(self) -> torch.device:
        return self.drafter.device

    # -- per request ----------------------------------------------------------------------------------------
    def _row(self, request_id: str, context: Sequence[int]) -> _Row:
        ctx = _as_list(context)
        row = self._rows.get(request_id)
        if row is None or not row.target.extends(ctx):
            row = _Row(_TargetText(self.target_tok, self._target_specials),
                       _DraftIds(self.draft_tok, self._bos, self.margin))
            self._rows[request_id] = row
        for t in ctx[len(row.target.ids) :]:
            row.target.push(int(t))
        row.draft_ctx = row.draft.encode(row.target.text)
        return row

    def _fits(self, row: _Row, num_draft: int) -> bool:
        """Whether the draft model's cache holds the row's context in its tokens plus the drafts (a tokenizer with
        more tokens per text than the target's fills it sooner; such a row stops drafting, it never fails)."""
        max_len = getattr(self.drafter.model, "max_len", None)
        return bool(row.draft_ctx) and (not max_len or len(row.draft_ctx) + num_draft + 1 <= max_len)

    def admit(self, request_id: str, context: Sequence[int]) -> None:
        row = self._row(request_id, context)
        if self._fits(row, 0):
            self.drafter.admit(request_id, row.draft_ctx)

    def release(self, request_id: str) -> None:
        self._rows.pop(request_id, None)
        self.drafter.release(request_id)

    # -- drafting -------------------------------------------------------------------------------------------
    def propose(self, rows, k, sampling: SamplingTensors, steps, draft_top_k) -> DraftBlock:
        found: list[list[int]] = [[] for _ in rows]
        idx, sub = [], []
        for b, r in enumerate(rows):
            if not r.num_draft:
                continue
            row = self._row(r.request_id, r.context)
            if self._fits(row, r.num_draft + self.extra):
                idx.append(b)
                sub.append(ProposeRow(r.request_id, row.draft_ctx, r.num_draft + self.extra))
        if sub:
            sel = torch.tensor(idx, dtype=torch.int64)
            block = self.drafter.propose(sub, max(s.num_draft for s in sub), sampling.select(idx),
                                         steps[sel.to(steps.device)], draft_top_k)
            proposed = block.token_ids.tolist()  # one device-to-host copy
            for j, b in enumerate(idx):  # each row's own K' only: its drafts never depend on the batch
                found[b] = self.to_target(self._rows[rows[b].request_id], proposed[j][: sub[j].num_draft],
                                          rows[b].num_draft)
        tokens = _padded(found, k)  # [B, k]
        counts = torch.tensor([len(f) for f in found], dtype=torch.int64)
        # Point masses: the drafter's probabilities are over its own vocabulary.
        top_probs = (torch.arange(k)[None, :] < counts[:, None]).float()[:, :, None]  # [B, k, 1]
        return DraftBlock(tokens, counts, tokens[:, :, None].clone(), top_probs)

    def to_target(self, row: _Row, proposed: Sequence[int], num_draft: int) -> list[int]:
        """The target tokens that the drafter's `proposed` ids add to the row's context (at most num_draft);
        [] where they cannot be placed exactly."""
        cut = next((i for i, t in enumerate(proposed) if t in self._draft_specials), len(proposed))
        proposed = list(proposed[:cut])
        if not proposed:
            return []
        before_ids = [t for t in row.draft_ctx[-4:] if t not in self._draft_specials]
        before = _decode(self.draft_tok, before_ids)
        after = _decode(self.draft_tok, before_ids + proposed)
        if not after.startswith(before):
            return []
        new_text = after[len(before) :].rstrip("\ufffd")  # a character whose last bytes are not drafted yet
        if not new_text:
            return []
        target = row.target
        j = target.boundary(self.lookback)
        if j is None:
            return []
        ids = _encode(self.target_tok, target.text[target.start(j) :] + new_text)
        own = target.ids[j:]
        if ids[: len(own)] != own:
            self.cut_rows += 1
            return []  # the merged text re-tokenizes the context itself differently
        return ids[len(own) : -1][:num_draft]  # the last token may change once more text follows
