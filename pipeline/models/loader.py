"""`load_model`: a model folder (or .gguf file, or the demo name) -> a `CausalLM` runner and its tokenizer.

The fast path (`llama.py`) is picked when the config's model_type is one of its families (`families.py`: Llama,
Mistral, Qwen2/3, Gemma 2, Gemma 3 text) and every feature it uses is supported; anything else runs on the generic
HF runner (`hf_generic.py`). `runner_choice` says which, and why, in one line (logged; the CLI prints it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from pipeline.models import store
from pipeline.models.base import CausalLM, ModelInfo

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def model_folder(path: str | Path | None) -> Path:
    """Resolve `path` (folder, .gguf file, demo name or None) to a checked model folder."""
    folder = store.resolve(None if path is None else str(path))
    if not (folder / "config.json").exists():
        raise ValueError(f"not a model folder (no config.json): {path}")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ValueError(f"no weights (*.safetensors or *.bin) in model folder: {path}")
    return folder


def load_tokenizer(path: str | Path | None):  # -> transformers.PreTrainedTokenizerBase | None
    """The folder's `AutoTokenizer`, or None when the folder has no tokenizer files (tiny test models)."""
    from transformers import AutoTokenizer

    folder = model_folder(path)
    if not any((folder / f).exists() for f in _TOKENIZER_FILES):
        log.info("no tokenizer files in %s", folder)
        return None
    return AutoTokenizer.from_pretrained(folder)


def load_model(
    path: str | Path | None, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32"
) -> tuple[CausalLM, Any]:
    """Load a model runner and its tokenizer (None if the folder has none).

    `path`: an HF folder (config.json + *.safetensors), a `.gguf` file (converted once through the
    store), or None / `store.DEMO_TARGET` for the demo model. Call `allocate()` on the runner before use.
    """
    torch_dtype = parse_dtype(dtype)
    folder = model_folder(path)
    device = torch.device(device)
    # The raw config.json: the fast path reads both the transformers-5 and the older key names itself,
    # and skipping AutoConfig saves ~2 s of first-time transformers imports.
    config_dict = json.loads((folder / "config.json").read_text())
    tokenizer = load_tokenizer(folder)

    reason = _fast_path_reason(folder, config_dict)
    line = _choice_line(folder, config_dict, reason, device)
    if reason is not None and config_dict.get("model_type") in _fast_path_types():
        log.warning("%s", line)  # a fast-path family that falls back: worth a warning
    else:
        log.info("%s", line)

    if reason is None:
        from pipeline.models.llama import LlamaCausalLM, load_transformer

        model = load_transformer(folder, config_dict, device=device, dtype=torch_dtype)
        vocab_size = model.output.weight.shape[0]
    else:
        from transformers import AutoModelForCausalLM

        # Attention logit soft-capping (Gemma 2) is computed by the eager attention only: transformers' SDPA path
        # leaves it out (seen with transformers 5.17 on CUDA, where SDPA is the default).
        eager = {"attn_implementation": "eager"} if config_dict.get("attn_logit_softcapping") else {}
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, **eager).to(device)
        vocab_size = model.get_output_embeddings().weight.shape[0]

    # A reduced draft vocabulary (a drafter made by `specserve distill`; see draft_vocab.py).
    from pipeline.models.draft_vocab import MappedEmbedding, input_map, output_rows, read_draft_vocab

    draft_vocab = read_draft_vocab(folder)
    if draft_vocab is not None:
        token_ids, target_vocab = draft_vocab
        id_to_row = input_map(token_ids, target_vocab)
        if reason is None:
            model.tok_embeddings = MappedEmbedding(model.tok_embeddings, id_to_row)
            model.output = output_rows(model.output.weight, len(token_ids))
        else:
            model.set_input_embeddings(MappedEmbedding(model.get_input_embeddings(), id_to_row))
            model.set_output_embeddings(output_rows(model.get_output_embeddings().weight, len(token_ids)))
        vocab_size = len(token_ids)

    info = ModelInfo(
        name=folder.name,
        path=str(folder),
        vocab_size=vocab_size,
        eos_token_ids=eos_token_ids(folder, config_dict, tokenizer),
        max_position_embeddings=_max_positions(config_dict),
        architecture=(config_dict.get("architectures") or [type(model).__name__])[0],
        num_parameters=sum(p.numel() for p in model.parameters()),  # shared (tied) tensors counted once
        fast_path=reason is None,
        output_token_ids=None if draft_vocab is None else tuple(draft_vocab[0].tolist()),
        input_vocab_size=None if draft_vocab is None else draft_vocab[1],
    )
    if reason is None:
        runner: CausalLM = LlamaCausalLM(model, info)
    else:
        from pipeline.models.hf_generic import HFGenericCausalLM

        runner = HFGenericCausalLM(model, info)
    log.info("loaded %s (%s, %.1fM params, %s, fast_path=%s)", info.name, info.architecture,
             info.num_parameters / 1e6, torch_dtype, info.fast_path)
    return runner, tokenizer


def _fast_path_types() -> frozenset[str]:
    from pipeline.models.llama import FAST_PATH_MODEL_TYPES

    return FAST_PATH_MODEL_TYPES


def _fast_path_reason(folder: Path, config: dict[str, Any]) -> str | None:
    """None when the fast path loads this folder, else why not."""
    from pipeline.models.llama import unsupported_reason

    reason = unsupported_reason(config)
    if reason is None and not any(folder.glob("*.safetensors")):
        reason = "no *.safetensors weights"
    return reason


def _choice_line(folder: Path, config: dict[str, Any], reason: str | None, device: str | torch.device) -> str:
    model_type = config.get("model_type")
    if reason is not None:
        return f"{folder.name}: generic HF runner, not the fast path: {reason}"
    line = f"{folder.name}: fast path (model_type {model_type!r})"
    if torch.device(device).type == "cuda":
        from pipeline.models.graphs import graph_features, graph_path_reason
        from pipeline.models.llama import LlamaArgs

        args = LlamaArgs.from_hf(config)
        graphs, features = graph_path_reason(args), graph_features(args)
        if graphs is not None:
            line += f"; eager on CUDA, {graphs}"
        else:  # what the captured graphs' kernels take on beyond Llama's layer
            line += "; CUDA graph path" + (f" with {features}" if features else "")
    return line


def runner_choice(path: str | Path | None, device: str | torch.device = "cpu") -> str:
    """One line naming the runner `load_model(path, device)` picks (fast path, with or without CUDA graphs, or the
    generic HF runner) and why. Reads config.json only."""
    folder = model_folder(path)
    config = json.loads((folder / "config.json").read_text())
    return _choice_line(folder, config, _fast_path_reason(folder, config), device)


def eos_token_ids(folder: Path, config: dict[str, Any], tokenizer: Any = None) -> tuple[int, ...]:
    """Union, in order, of the EOS ids of generation_config.json, config.json and the tokenizer."""
    found: list[int] = []

    def add(value: Any) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v not in found:
                found.append(v)

    gen_file = folder / "generation_config.json"
    if gen_file.exists():
        add(json.loads(gen_file.read_text()).get("eos_token_id"))
    add(config.get("eos_token_id"))
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    return tuple(found)


def _max_positions(config: dict[str, Any]) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(config.get(key), int):
            return config[key]
    return 0
