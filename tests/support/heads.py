"""Feature-head checkpoints in the published layouts (random weights) and plain reference forwards of them.

The references read the checkpoint's tensors by their published names and the target's hidden states from
transformers (`output_hidden_states`), recomputing every draft from scratch: nothing of pipeline.heads is used.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file


def make_medusa_checkpoint(folder: Path, hidden: int, vocab: int, heads: int = 3, layers: int = 1,
                           seed: int = 0, prefix: str = "medusa_head.") -> Path:
    """Medusa's `medusa_lm_head` layout: one block object repeated `layers` times per head (equal tensors under
    each block index), then the head's output layer."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(heads):
        w, b = torch.randn(hidden, hidden, generator=g) * hidden**-0.5, torch.randn(hidden, generator=g) * 0.1
        for j in range(layers):
            state[f"{prefix}{i}.{j}.linear.weight"], state[f"{prefix}{i}.{j}.linear.bias"] = w.clone(), b.clone()
        state[f"{prefix}{i}.{layers}.weight"] = torch.randn(vocab, hidden, generator=g) * hidden**-0.5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "medusa_lm_head.safetensors"))
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": heads, "medusa_num_layers": layers,
                                                    "base_model_name_or_path": "tiny"}))
    return folder


def make_eagle3_checkpoint(folder: Path, target_config: dict, draft_vocab: int, seed: int = 0,
                           aux_layers: list[int] | None = None, own_embed: bool = False) -> Path:
    """vLLM/SGLang's `LlamaForCausalLMEagle3` layout: config keys and tensor names, d2t offsets, t2d mask."""
    g = torch.Generator().manual_seed(seed)
    C, V = target_config["hidden_size"], target_config["vocab_size"]
    H, Hkv = target_config["num_attention_heads"], target_config["num_key_value_heads"]
    D, inter = C // H, 2 * C

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    def norm():
        return 1.0 + 0.1 * torch.randn(C, generator=g)

    chosen = torch.sort(torch.randperm(V, generator=g)[:draft_vocab]).values
    state = {
        "fc.weight": rnd(C, 3 * C), "norm.weight": norm(), "lm_head.weight": rnd(draft_vocab, C),
        "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": rnd(H * D, 2 * C), "midlayer.self_attn.k_proj.weight": rnd(Hkv * D, 2 * C),
        "midlayer.self_attn.v_proj.weight": rnd(Hkv * D, 2 * C), "midlayer.self_attn.o_proj.weight": rnd(C, H * D),
        "midlayer.mlp.gate_proj.weight": rnd(inter, C), "midlayer.mlp.up_proj.weight": rnd(inter, C),
        "midlayer.mlp.down_proj.weight": rnd(C, inter),
        "d2t": chosen - torch.arange(draft_vocab), "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, chosen, True),
    }
    if own_embed:
        state["embed_tokens.weight"] = torch.randn(V, C, generator=g)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": C,
              "num_attention_heads": H, "num_key_value_heads": Hkv, "intermediate_size": inter, "vocab_size": V,
              "draft_vocab_size": draft_vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "num_hidden_layers": 1,
              "max_position_embeddings": 512, "hidden_act": "silu", "tie_word_embeddings": False}
    if aux_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers, "use_aux_hidden_state": True}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def target_states(target, ids: list[int]) -> tuple[torch.Tensor, ...]:
    """transformers' hidden states of `ids`: [i] enters layer i, the last is after the final norm; [T, C] each."""
    with torch.no_grad():
        out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states)


def medusa_reference(target, folder: Path, context: list[int], k: int) -> list[int]:
    """Greedy Medusa drafts after `context` (its last token pending): the heads on the final normed state of the
    position before the pending token."""
    raw = json.loads((folder / "config.json").read_text())
    raw_state = load_file(str(folder / "medusa_lm_head.safetensors"))
    state = {k_.removeprefix("medusa_head."): v for k_, v in raw_state.items()}
    L = raw["medusa_num_layers"]
    h = target_states(target, context[:-1])[-1][-1]
    drafts = []
    for i in range(min(k, raw["medusa_num_heads"])):
        x = h
        for j in range(L):
            x = x + F.silu(x @ state[f"{i}.{j}.linear.weight"].T + state[f"{i}.{j}.linear.bias"])
        drafts.append(int((x @ state[f"{i}.{L}.weight"].T).argmax()))
    return drafts


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:  # [T, H, D]
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2).float() / D)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def eagle3_reference(target, folder: Path, context: list[int], k: int) -> list[int]:
    """Greedy EAGLE-3 drafts after `context`, recomputed from scratch at every depth: pairs (fc of the target's
    aux states at p, token p+1) for the committed positions, then (the head's own pre-norm output, its draft)."""
    cfg = json.loads((folder / "config.json").read_text())
    s = load_file(str(folder / "model.safetensors"))
    n_layers = target.config.num_hidden_layers
    aux = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [2, n_layers // 2, n_layers - 3]
    states = target_states(target, context[:-1])
    feats = torch.cat([states[i] for i in aux], -1)  # [m, 3C]: states entering each aux layer
    embed = s.get("embed_tokens.weight", target.get_input_embeddings().weight.detach())
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hs = list(feats @ s["fc.weight"].T)  # the residual input of each pair
    toks = list(context[1:])
    drafts: list[int] = []
    for _ in range(k):
        h, t = torch.stack(hs), torch.tensor(toks)
        T, C = h.shape
        D = C // H
        x = torch.cat([_rms(embed[t], s["midlayer.input_layernorm.weight"], eps),
                       _rms(h, s["midlayer.hidden_norm.weight"], eps)], -1)
        pos = torch.arange(T)
        q = _rope((x @ s["midlayer.self_attn.q_proj.weight"].T).view(T, H, D), pos, theta)
        kk = _rope((x @ s["midlayer.self_attn.k_proj.weight"].T).view(T, Hkv, D), pos, theta)
        v = (x @ s["midlayer.self_attn.v_proj.weight"].T).view(T, Hkv, D)
        kk, v = kk.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        att = torch.einsum("thd,shd->hts", q, kk) / math.sqrt(D)
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
        y = torch.einsum("hts,shd->thd", att, v).reshape(T, H * D)
        r = h + y @ s["midlayer.self_attn.o_proj.weight"].T
        z = _rms(r, s["midlayer.post_attention_layernorm.weight"], eps)
        r = r + (F.silu(z @ s["midlayer.mlp.gate_proj.weight"].T) * (z @ s["midlayer.mlp.up_proj.weight"].T)) \
            @ s["midlayer.mlp.down_proj.weight"].T
        row = int((_rms(r[-1], s["norm.weight"], eps) @ s["lm_head.weight"].T).argmax())
        token = row + int(s["d2t"][row])
        drafts.append(token)
        hs.append(r[-1])
        toks.append(token)
    return drafts
