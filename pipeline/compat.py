"""Draft/target compatibility: a drafter must speak the target's vocabulary, token for token.

A mismatch does not crash anything on its own: the target would verify draft ids that mean other words,
reject almost everything and silently run slower than no speculation (e.g. a Llama drafter for a Mistral
target). So it is refused at load, with both sizes named.
"""

from __future__ import annotations

from typing import Any

from pipeline.models.base import ModelInfo


class IncompatibleDrafter(ValueError):
    pass


def check_compatible(target: ModelInfo, target_tok: Any | None, draft: ModelInfo, draft_tok: Any | None) -> None:
    t_size, d_size = _input_vocab(target, target_tok), _input_vocab(draft, draft_tok)
    if target_tok is not None and draft_tok is not None:
        t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
        if t_vocab != d_vocab:
            differing = sum(1 for tok, i in d_vocab.items() if t_vocab.get(tok) != i)
            raise IncompatibleDrafter(
                f"draft tokenizer differs from the target's: draft {draft.name} has {len(d_vocab)} tokens, "
                f"target {target.name} has {len(t_vocab)} ({differing} draft tokens map to other ids)"
            )
    if t_size != d_size:
        raise IncompatibleDrafter(
            f"draft and target vocabularies differ: draft {draft.name} has {d_size} tokens, "
            f"target {target.name} has {t_size}"
        )
    out_ids = getattr(draft, "output_token_ids", None)
    if out_ids is not None and max(out_ids) >= target.vocab_size:
        raise IncompatibleDrafter(
            f"draft {draft.name} proposes token id {max(out_ids)}, beyond the target's vocabulary ({target.vocab_size})"
        )


def _input_vocab(info: ModelInfo, tokenizer: Any | None) -> int:
    """The embedding size the model was built for (its output layer may be reduced, see FR-Spec)."""
    return int(getattr(info, "input_vocab_size", None) or info.vocab_size)
