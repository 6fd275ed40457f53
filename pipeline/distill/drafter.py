"""The drafter: a small causal LM of the target's architecture over a reduced vocabulary.

Layout of a drafter folder (plain Hugging Face format plus one small file):
    config.json, model.safetensors   a `LlamaForCausalLM` (or the target's architecture) whose vocabulary is
                                     the V' draft tokens plus one "other" row: row j < V' is token
                                     token_ids[j]; row V' stands for every other input token.
    draft_vocab.safetensors          `token_ids` [V'] int64, metadata {target_vocab_size, oov_row}
    tokenizer files                  the target's (the drafter reads and writes target token ids)
    distill.json                     how it was made (command, data, metrics)

Inputs are target token ids mapped to rows (`input_map`, unknown -> V'); outputs are logits over the V'
rows, i.e. over tokens token_ids[0..V'). Input and output share one matrix (tied) when the target's are
tied. With `draft_vocab == 0` the drafter keeps the full vocabulary and no draft_vocab file is written.
Everything is initialised from the target (embedding rows, first layers, final norm) when widths match.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.models.draft_vocab import DRAFT_VOCAB_FILE, input_map, read_draft_vocab

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "tokenizer.model", "vocab.json", "merges.txt")


class DraftModel(nn.Module):
    """An HF causal LM plus the map between target token ids and its vocabulary rows."""

    def __init__(self, lm: Any, token_ids: torch.Tensor | None, target_vocab_size: int) -> None:
        super().__init__()
        self.lm = lm
        self.target_vocab_size = target_vocab_size
        if token_ids is None:
            self.register_buffer("token_ids", None, persistent=False)
            self.register_buffer("input_map", None, persistent=False)
        else:
            self.register_buffer("token_ids", token_ids.clone().to(torch.int64), persistent=False)
            self.register_buffer("input_map", input_map(token_ids, target_vocab_size), persistent=False)

    @property
    def num_outputs(self) -> int:
        return self.target_vocab_size if self.token_ids is None else len(self.token_ids)

    def rows(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, T] target ids -> [B, T] rows
        return input_ids if self.input_map is None else self.input_map[input_ids]

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, H] (after the final norm)
        return self.lm.model(input_ids=self.rows(input_ids), use_cache=False).last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V'] over the draft tokens
        weight = self.lm.get_output_embeddings().weight[: self.num_outputs]
        return hidden @ weight.T

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, V']
        return self.logits(self.hidden(input_ids))

    def to_token_ids(self, rows: torch.Tensor) -> torch.Tensor:  # output row index -> target token id
        return rows if self.token_ids is None else self.token_ids[rows]

    def matmul_params(self) -> int:
        """Parameters touched by matrix products per token (layers + output rows): the cost measure."""
        layers = sum(p.numel() for n, p in self.lm.model.layers.named_parameters() if p.dim() == 2)
        return layers + self.num_outputs * self.lm.config.hidden_size


def target_matmul_params(target: Any) -> int:
    layers = sum(p.numel() for n, p in target.model.layers.named_parameters() if p.dim() == 2)
    return layers + target.get_output_embeddings().weight.numel()


def build_drafter(
    target: Any,
    token_ids: torch.Tensor | None,  # [V'] draft tokens, or None: full vocabulary
    num_layers: int,
    init_layers: str = "first",  # "first" | "spread" | "random"
    hidden: int | None = None,  # None: the target's width
    seed: int = 0,
) -> DraftModel:
    """A float32 drafter of the target's architecture with `num_layers` layers, initialised from the target."""
    from transformers import AutoModelForCausalLM

    tcfg = target.config
    cfg = copy.deepcopy(tcfg)  # never share: HF runs layers[:config.num_hidden_layers] (ENVIRONMENT pitfall)
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    target_vocab = tcfg.vocab_size
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:num_layers]
    cfg.vocab_size = target_vocab if token_ids is None else len(token_ids) + 1
    if hidden is not None and hidden != tcfg.hidden_size:
        heads = max(1, hidden // getattr(tcfg, "head_dim", tcfg.hidden_size // tcfg.num_attention_heads))
        cfg.hidden_size, cfg.intermediate_size = hidden, int(hidden * tcfg.intermediate_size / tcfg.hidden_size)
        cfg.num_attention_heads = heads
        cfg.num_key_value_heads = max(1, heads * tcfg.num_key_value_heads // tcfg.num_attention_heads)
        cfg.head_dim = hidden // heads
        init_layers = "random"
    cfg.dtype = torch.float32
    torch.manual_seed(seed)
    lm = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    draft = DraftModel(lm, token_ids, target_vocab)
    if init_layers == "random":
        return draft

    n_target = tcfg.num_hidden_layers
    if init_layers == "first":
        src_layers = list(range(num_layers))
    else:  # spread: first and last, evenly in between
        src_layers = [round(i * (n_target - 1) / max(num_layers - 1, 1)) for i in range(num_layers)]
    tsd = target.state_dict()
    new = {}
    for i, s in enumerate(src_layers):
        prefix = f"model.layers.{s}."
        for k, v in tsd.items():
            if k.startswith(prefix):
                new[f"model.layers.{i}." + k[len(prefix):]] = v
    new["model.norm.weight"] = tsd["model.norm.weight"]
    emb = target.get_input_embeddings().weight.detach().float()
    out = target.get_output_embeddings().weight.detach().float()
    if token_ids is None:
        new["model.embed_tokens.weight"] = emb
        if not tcfg.tie_word_embeddings:
            new["lm_head.weight"] = out
    else:
        ids = token_ids.to(emb.device)
        new["model.embed_tokens.weight"] = torch.cat([emb[ids], emb.mean(0, keepdim=True)])
        if not tcfg.tie_word_embeddings:
            new["lm_head.weight"] = torch.cat([out[ids], torch.zeros_like(out[:1])])
    missing, unexpected = lm.load_state_dict({k: v.float().cpu() for k, v in new.items()}, strict=False)
    allowed_missing = {"lm_head.weight"} if tcfg.tie_word_embeddings else set()
    bad = [m for m in missing if m not in allowed_missing and "rotary" not in m]
    assert not bad and not unexpected, f"drafter init from target: missing {bad}, unexpected {unexpected}"
    if tcfg.tie_word_embeddings:
        lm.tie_weights()
    return draft


def save_drafter(
    draft: DraftModel,
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    tokenizer_src: Path | None = None,
    eos_token_ids: list[int] | None = None,
    meta: dict[str, Any] | None = None,
    max_shard_size: str | None = None,
) -> Path:
    """Write the drafter as an HF folder (+ draft_vocab.safetensors, tokenizer files, distill.json)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lm = copy.deepcopy(draft.lm).to(device="cpu", dtype=dtype)
    lm.config.dtype = dtype
    if eos_token_ids:
        lm.config.eos_token_id = eos_token_ids[0] if len(eos_token_ids) == 1 else list(eos_token_ids)
        lm.generation_config.eos_token_id = lm.config.eos_token_id
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    lm.save_pretrained(out, safe_serialization=True, **kw)
    if draft.token_ids is not None:
        save_file({"token_ids": draft.token_ids.cpu().contiguous()}, str(out / DRAFT_VOCAB_FILE),
                  metadata={"target_vocab_size": str(draft.target_vocab_size), "oov_row": str(len(draft.token_ids))})
    if tokenizer_src is not None and tokenizer_src.is_dir():
        for name in _TOKENIZER_FILES:
            if (tokenizer_src / name).exists():
                shutil.copy2(tokenizer_src / name, out / name)
    if meta is not None:
        (out / "distill.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return out


def load_draft_model(folder: str | Path, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32) -> DraftModel:
    """A saved drafter as a `DraftModel` (for evaluation and further training)."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    vocab = read_draft_vocab(folder)
    if vocab is None:
        return DraftModel(lm, None, lm.config.vocab_size).to(device)
    return DraftModel(lm, vocab[0], vocab[1]).to(device)


def load_hf_assistant(folder: str | Path, device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32) -> Any:
    """The drafter as a plain HF model over the target's full vocabulary, for `generate(assistant_model=...)`:
    inputs are mapped to rows, outputs scattered back to target ids (-inf elsewhere)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = read_draft_vocab(folder)
    if vocab is None:
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    token_ids, target_vocab = vocab
    import transformers

    base_cls = getattr(transformers, AutoConfig.from_pretrained(str(folder)).architectures[0])

    class ReducedVocabAssistant(base_cls):  # type: ignore[misc, valid-type]
        def forward(self, input_ids=None, **kw):  # noqa: D401 - HF signature
            rows = self._specserve_input_map.to(input_ids.device)[input_ids] if input_ids is not None else None
            out = super().forward(input_ids=rows, **kw)
            logits = out.logits[..., : len(self._specserve_token_ids)]
            full = logits.new_full((*logits.shape[:-1], self._specserve_target_vocab), torch.finfo(logits.dtype).min)
            full[..., self._specserve_token_ids.to(logits.device)] = logits
            out.logits = full
            return out

    model = ReducedVocabAssistant.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    model._specserve_input_map = input_map(token_ids, target_vocab).to(device)
    model._specserve_token_ids = token_ids.to(device)
    model._specserve_target_vocab = target_vocab
    model.config.vocab_size = target_vocab  # what assisted generation compares with the target's
    return model
