"""An EAGLE-3 head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test"), in the layout of vLLM's and SGLang's `LlamaForCausalLMEagle3` checkpoints.

At position p the head reads the pair (feature of p, token p+1) and predicts token p+2:
    h = fc([a_lo; a_mid; a_hi])                            the target's states entering three of its layers, 3H -> H
    x = [input_layernorm(embed(token)); hidden_norm(h)]    2H: the one decoder layer's attention input
    r = h + attn(x);  r = r + mlp(post_attention_layernorm(r))
    logits = lm_head(norm(r)) over `draft_vocab_size` rows; row j is target token j + d2t[j]
After the first draft the head goes on from its own pre-norm output r (no fc) and the token it drafted, at the
next position: its own KV cache (slot-indexed, like the target's) holds every committed pair and the drafts of
this pass, which the next pass overwrites.

Checkpoint folder: `config.json` (`architectures: ["LlamaForCausalLMEagle3"]`, `hidden_size`,
`num_attention_heads`, `num_key_value_heads`, `intermediate_size`, `rms_norm_eps`, `rope_theta`, `vocab_size`,
`draft_vocab_size`, optionally `head_dim`, `target_hidden_size`, `rope_scaling` and
`eagle_config.eagle_aux_hidden_state_layer_ids`; default layers (2, n // 2, n - 3) of an n-layer target, as
vLLM) and safetensors with `fc.weight`, `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`,
`lm_head.weight`, `d2t` (int64 offsets) and `t2d` (bool, which target tokens are drafted; not needed to draft);
`embed_tokens.weight` where the head has its own embedding, else the target's is used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from pipeline.models.llama import apply_rope, rms_norm, rope_inv_freq
from pipeline.models.tree_attention import TreeMask, tree_rope_and_mask

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    target_hidden_size: int | None = None  # None: hidden_size
    aux_layers: tuple[int, ...] | None = None  # target layers whose input states are fused; None: (2, n//2, n-3)

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def feature_size(self) -> int:
        return self.target_hidden_size or self.hidden_size

    def layers_for(self, n_target_layers: int) -> tuple[int, ...]:
        return self.aux_layers or (2, n_target_layers // 2, n_target_layers - 3)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "Eagle3Config":
        aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(hidden_size=raw["hidden_size"], num_attention_heads=raw["num_attention_heads"],
                   num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
                   intermediate_size=raw["intermediate_size"], vocab_size=raw["vocab_size"],
                   draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
                   rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=raw.get("rope_theta", 10000.0),
                   rope_scaling=raw.get("rope_scaling"), head_dim=raw.get("head_dim"),
                   target_hidden_size=raw.get("target_hidden_size"), aux_layers=tuple(aux) if aux else None)

    def to_hf(self) -> dict[str, Any]:
        out = {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": self.hidden_size,
               "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
               "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
               "draft_vocab_size": self.draft_vocab_size, "rms_norm_eps": self.rms_norm_eps,
               "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling, "head_dim": self.dim_head,
               "num_hidden_layers": 1, "hidden_act": "silu", "tie_word_embeddings": False}
        if self.target_hidden_size:
            out["target_hidden_size"] = self.target_hidden_size
        if self.aux_layers:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
                                   "use_aux_hidden_state": True}
        return out


def is_eagle3_folder(folder: Path) -> bool:
    cfg = folder / "config.json"
    return cfg.exists() and ARCHITECTURE in (json.loads(cfg.read_text()).get("architectures") or [])


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config, embed: torch.Tensor | None = None) -> None:
        super().__init__()
        self.cfg = c = cfg
        C, H, Hkv, D = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.dim_head
        self.own_embed = embed is None
        if embed is None:
            self.embed = nn.Parameter(torch.zeros(c.vocab_size, C))
        else:
            self.register_buffer("embed", embed, persistent=False)
        self.fc = nn.Linear(3 * c.feature_size, C, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(C))
        self.hidden_norm = nn.Parameter(torch.ones(C))
        self.post_attention_layernorm = nn.Parameter(torch.ones(C))
        self.norm = nn.Parameter(torch.ones(C))
        self.q_proj = nn.Linear(2 * C, H * D, bias=False)
        self.k_proj = nn.Linear(2 * C, Hkv * D, bias=False)
        self.v_proj = nn.Linear(2 * C, Hkv * D, bias=False)
        self.o_proj = nn.Linear(H * D, C, bias=False)
        self.gate_proj = nn.Linear(C, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(C, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, C, bias=False)
        self.lm_head = nn.Linear(C, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.inv_freq = rope_inv_freq(D, c.rope_theta, c.rope_scaling)  # float32 whatever the weights' dtype
        self.k_cache = self.v_cache = torch.empty(0)

    # -- the layer ----------------------------------------------------------------------------------------
    def token_ids(self, rows: torch.Tensor) -> torch.Tensor:  # draft row -> target token id
        return rows + self.d2t[rows]

    def _rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos.float()[..., None] * self.inv_freq.to(pos.device)  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _qkv(self, tokens: torch.Tensor, h: torch.Tensor, pos: torch.Tensor):
        """q [B, T, H, D], k, v [B, T, Hkv, D] (RoPE at `pos` [B, T]) of the pairs (token, fused feature h)."""
        c, eps = self.cfg, self.cfg.rms_norm_eps
        B, T, _ = h.shape
        e = F.embedding(tokens, self.embed).to(h.dtype)
        x = torch.cat([rms_norm(e, self.input_layernorm, eps), rms_norm(h, self.hidden_norm, eps)], dim=-1)
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.dim_head)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.dim_head)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.dim_head)
        cos, sin = self._rope(pos, h.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _out(self, h: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, T, V'] float32, pre-norm output [B, T, C]) from the residual input h and attention [B, T, HD]."""
        eps = self.cfg.rms_norm_eps
        r = h + self.o_proj(attn)
        y = rms_norm(r, self.post_attention_layernorm, eps)
        r = r + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))
        return self.lm_head(rms_norm(r, self.norm, eps)).float(), r

    # -- drafting over a slot-indexed cache -------------------------------------------------------------------
    def allocate(self, num_slots: int, max_len: int) -> None:
        c = self.cfg
        shape = (num_slots, c.num_key_value_heads, max_len, c.dim_head)
        self.k_cache = torch.zeros(shape, device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.inv_freq = self.inv_freq.to(self.fc.weight.device)  # no host-to-device copy inside a step

    @property
    def num_slots(self) -> int:
        return self.k_cache.shape[0] if self.k_cache.dim() == 4 else 0

    @property
    def max_len(self) -> int:
        return self.k_cache.shape[2] if self.k_cache.dim() == 4 else 0

    @torch.inference_mode()
    def step(
        self,
        tokens: torch.Tensor,  # [B, T] int64 target ids: the token after each position
        features: torch.Tensor,  # [B, T, 3 Ft] the target's states (fused=True), or [B, T, C] the head's own r
        positions: torch.Tensor,  # [B] int64 position of column 0
        slots: torch.Tensor,  # [B] int64
        fused: bool,
        span: int | None = None,  # cache positions the attention reads; None: up to the last one fed
        tree: TreeMask | None = None,  # the pairs are nodes of a token tree (pipeline.models.tree_attention)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [B, T, V'] float32, r [B, T, C]
        """Write the pairs' keys and values at their positions of each row's slot, attend causally over the slot,
        and return the logits and pre-norm output of every pair. With `span` (the cache length) the shapes do not
        depend on the positions, so a step can be captured in a CUDA graph (`pipeline.device_loop`); the mask
        hides the keys past each query either way. With `tree`, `positions` is the cache index of the call's first
        pair in the tree region, and each pair is rotated by its depth and attends to the prefix and its own
        ancestors (`tree_rope_and_mask`)."""
        dev = self.fc.weight.device
        B, T = tokens.shape
        S = int(positions.max()) + T if span is None else span  # a host read only where positions are on the device
        tokens, positions, slots = tokens.to(dev), positions.to(dev), slots.to(dev)
        h = features.to(dev, self.fc.weight.dtype)
        if fused:
            h = self.fc(h)
        pos = positions[:, None] + torch.arange(T, device=dev)  # [B, T] cache index of each pair
        if tree is None:
            rope_pos = pos
            mask = (torch.arange(S, device=dev)[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, T, S]
        else:
            rope_pos, masks = tree_rope_and_mask(tree, positions, T, S, {None})
            mask = masks[None]
        q, k, v = self._qkv(tokens, h, rope_pos)
        self.k_cache[slots[:, None], :, pos] = k
        self.v_cache[slots[:, None], :, pos] = v
        keys = self.k_cache[:, :, :S].index_select(0, slots)  # [B, Hkv, S, D]
        values = self.v_cache[:, :, :S].index_select(0, slots)
        c = self.cfg
        y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                           enable_gqa=c.num_attention_heads != c.num_key_value_heads)
        return self._out(h, y.transpose(1, 2).reshape(B, T, -1))

    # -- training-time test ----------------------------------------------------------------------------------
    def train_forward(
        self,
        tokens: torch.Tensor,  # [B, T] int64: tokens[p] = the token after position p (input ids shifted by one)
        features: torch.Tensor,  # [B, T, 3 Ft] the target's states at every position
        depth: int,  # drafts per pass to train for
    ) -> list[torch.Tensor]:  # per depth d: [B, T, V'] logits at index p, predicting the token p + 2 + d
        """Every position as the last committed one, drafting `depth` tokens on from its own outputs, as it drafts
        in a pass (EAGLE-3's training-time test): at depth d, index p reads the token after position p + d and the
        head's own depth d-1 output at p, at position p + d, and attends to the committed pairs <= p and to its own
        earlier depths at p.

        Depth 0 is plain causal attention (SDPA's fused kernels); deeper queries add their own earlier depths at
        the same index as d extra keys, merged into the causal scores explicitly (`_ttt_attention`): no
        [T, (d+1) T] mask, and the committed keys are scored once per depth."""
        B, T = tokens.shape
        dev = tokens.device
        c = self.cfg
        G = c.num_attention_heads // c.num_key_value_heads
        h = self.fc(features)
        pos = torch.arange(T, device=dev)
        k0 = v0 = None
        extra_k: list[torch.Tensor] = []
        extra_v: list[torch.Tensor] = []
        outs = []
        for d in range(depth):
            toks = F.pad(tokens[:, d:], (0, d))  # the token after position p + d
            q, k, v = self._qkv(toks, h, (pos + d)[None].expand(B, T))
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H|Hkv, T, D]
            if d == 0:
                k0, v0 = k, v
                y = F.scaled_dot_product_attention(q, k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1),
                                                   is_causal=True)
            else:
                extra_k.append(k)
                extra_v.append(v)
                y = _ttt_attention(q, k0, v0, extra_k, extra_v)
            logits, h = self._out(h, y.transpose(1, 2).reshape(B, T, -1))
            outs.append(logits)
        return outs

    # -- checkpoints -------------------------------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        m = "midlayer."
        out = {"fc.weight": self.fc.weight, f"{m}input_layernorm.weight": self.input_layernorm,
               f"{m}hidden_norm.weight": self.hidden_norm, f"{m}post_attention_layernorm.weight":
               self.post_attention_layernorm, "norm.weight": self.norm, "lm_head.weight": self.lm_head.weight}
        for n in ("q", "k", "v", "o"):
            out[f"{m}self_attn.{n}_proj.weight"] = getattr(self, f"{n}_proj").weight
        for n in ("gate", "up", "down"):
            out[f"{m}mlp.{n}_proj.weight"] = getattr(self, f"{n}_proj").weight
        if self.own_embed:
            out["embed_tokens.weight"] = self.embed
        return out

    _LOCAL = {"fc.weight": "fc.weight", "norm.weight": "norm", "lm_head.weight": "lm_head.weight",
              "embed_tokens.weight": "embed", "midlayer.input_layernorm.weight": "input_layernorm",
              "midlayer.hidden_norm.weight": "hidden_norm",
              "midlayer.post_attention_layernorm.weight": "post_attention_layernorm",
              **{f"midlayer.self_attn.{n}_proj.weight": f"{n}_proj.weight" for n in "qkvo"},
              **{f"midlayer.mlp.{n}_proj.weight": f"{n}_proj.weight" for n in ("gate", "up", "down")}}


def _ttt_attention(
    q: torch.Tensor,  # [B, H, T, D] queries of depth d
    k0: torch.Tensor,  # [B, Hkv, T, D] committed keys (depth 0)
    v0: torch.Tensor,  # [B, Hkv, T, D]
    ks: list[torch.Tensor],  # d x [B, Hkv, T, D]: the same index's keys of depths 1..d
    vs: list[torch.Tensor],
) -> torch.Tensor:  # [B, H, T, D]
    """softmax over [q . k0[j] for j <= p] + [q . ks[e][p] for e < d], applied to [v0[j]] + [vs[e][p]]; query
    head h reads key head h // G (grouped-query attention)."""
    B, H, T, D = q.shape
    Hkv = k0.shape[1]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * T, D) * D**-0.5  # heads h = kv * G + g
    scores = (qg @ k0.transpose(-1, -2)).view(B, Hkv, G, T, T)  # [B, Hkv, G, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    qg = qg.view(B, Hkv, G, T, D)
    own = torch.stack([(qg * k[:, :, None]).sum(-1) for k in ks], dim=-1)  # [B, Hkv, G, T, d]
    probs = torch.cat([scores, own.to(scores.dtype)], dim=-1).float().softmax(-1).to(q.dtype)
    y = (probs[..., :T].reshape(B, Hkv, G * T, T) @ v0).view(B, Hkv, G, T, D)
    for e, v in enumerate(vs):
        y = y + probs[..., T + e, None] * v[:, :, None]
    return y.reshape(B, H, T, D)


def t2d_mask(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [V'] offsets -> [V] bool
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[torch.arange(len(d2t)) + d2t.cpu()] = True
    return mask


def save_eagle3(head: Eagle3Head, folder: str | Path, dtype: torch.dtype = torch.bfloat16,
                meta: dict | None = None) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.hf_state_dict().items()}
    state["d2t"] = head.d2t.cpu().contiguous()
    state["t2d"] = t2d_mask(head.d2t, head.cfg.vocab_size)
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**head.cfg.to_hf(), **(meta or {})}, indent=2) + "\n")


def load_eagle3(folder: str | Path, target_embed: torch.Tensor, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """An EAGLE-3 head from a checkpoint folder; `target_embed` [V, C] is the target's embedding matrix (used
    where the checkpoint has none; its shape is checked)."""
    folder = Path(folder)
    if not is_eagle3_folder(folder):
        raise ValueError(f"{folder}: config.json does not name {ARCHITECTURE}")
    cfg = Eagle3Config.from_hf(json.loads((folder / "config.json").read_text()))
    state: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    own = "embed_tokens.weight" in state
    if not own and tuple(target_embed.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"{folder}: the head reads the target's embedding [{cfg.vocab_size}, {cfg.hidden_size}], "
                         f"this target's is {list(target_embed.shape)}")
    head = Eagle3Head(cfg, None if own else target_embed.to(device, dtype))
    local = {Eagle3Head._LOCAL[k]: v for k, v in state.items() if k in Eagle3Head._LOCAL}
    local["d2t"] = state.get("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)).to(torch.int64)
    expected = set(head.state_dict())
    missing = sorted(expected - local.keys())
    if missing:
        raise ValueError(f"{folder}: weights missing: {missing}")
    for name, t in local.items():
        want = head.state_dict()[name].shape
        if t.shape != want:
            raise ValueError(f"{folder}: {name} has shape {tuple(t.shape)}, expected {tuple(want)}")
    head.load_state_dict(local, strict=True)
    head = head.to(device=device, dtype=dtype)
    head.d2t = head.d2t.to(torch.int64)
    return head.eval().requires_grad_(False)
