"""The target as a Hugging Face model: the teacher whose outputs and distributions the drafter learns.

Training needs batched, differentiable-shape forwards over padded sequences (not the serving runner's
slot cache), so the teacher is the plain `transformers` model, frozen.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_target(path: str | None, device: str | torch.device, dtype: str,
                need_tokenizer: bool = True) -> tuple[Any, Any | None, Path]:
    """(frozen HF causal LM on `device`, its tokenizer or None, the folder or .gguf file it came from).

    `path`: an HF folder, a `.gguf` file (read directly by transformers; needs the `gguf` package), or
    None for the demo target through the model store.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is None:
        from pipeline.models import store

        src = store.resolve(None)
    else:
        src = Path(path).expanduser()
    torch_dtype = DTYPES[dtype]
    if src.is_file() and src.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name) if need_tokenizer else None
    else:
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
        has_tok = any((src / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
        tokenizer = AutoTokenizer.from_pretrained(str(src)) if has_tok else None
    model = model.to(device=device, dtype=torch_dtype).eval().requires_grad_(False)
    return model, tokenizer, src


def eos_token_ids(model: Any, tokenizer: Any | None, src: Path) -> list[int]:
    """EOS ids of the generation config, the model config and the tokenizer, in that order."""
    found: list[int] = []

    def add(v: Any) -> None:
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, int) and x not in found:
                found.append(x)

    gen = src / "generation_config.json" if src.is_dir() else None
    if gen is not None and gen.exists():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    add(getattr(model.config, "eos_token_id", None))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    if not found:
        raise ValueError("the target declares no EOS token id (config, generation_config or tokenizer)")
    return found


def output_weight(model: Any) -> torch.Tensor:
    """The target's output layer [V, H] (its embedding matrix when tied)."""
    return model.get_output_embeddings().weight


@torch.no_grad()
def target_log_probs(
    model: Any,
    hidden: torch.Tensor,  # [N, H] final hidden states (after the final norm) at the positions that matter
    rows: torch.Tensor | None,  # [V'] token ids to keep, or None for all
    chunk: int = 8192,
) -> tuple[torch.Tensor, torch.Tensor]:  # [N, V'] float32 log-probs (full-vocabulary softmax), [N] argmax ids
    """Log-probabilities of the target over its full vocabulary, restricted to `rows` afterwards."""
    weight = output_weight(model)
    outs, tops = [], []
    for i in range(0, hidden.shape[0], chunk):
        logits = (hidden[i : i + chunk] @ weight.T).float()  # [n, V]
        logp = torch.log_softmax(logits, dim=-1)
        tops.append(logits.argmax(-1))
        outs.append(logp if rows is None else logp[:, rows])
    return torch.cat(outs), torch.cat(tops)
