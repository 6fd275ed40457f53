"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads"), in the layout of Medusa's `medusa_lm_head` checkpoints.

Head i (0-based) reads the target's last hidden state after the final norm at position t, the state whose output
layer gives token t+1, and predicts token t+2+i: L residual blocks `x + SiLU(W x + b)` then its own output layer.
All K heads draft in one pass from one feature; their drafts do not see each other (Medusa-1, frozen target).

Checkpoint folder: `config.json` with `medusa_num_heads` and `medusa_num_layers`, and the weights in
`medusa_lm_head.safetensors` (or any `*.safetensors`, or `medusa_lm_head.pt`) under the names
`medusa_head.{i}.{j}.linear.weight|bias` (block j < L) and `medusa_head.{i}.{L}.weight` (head i's output layer);
Medusa's own `torch.save(medusa_head.state_dict())` omits the `medusa_head.` prefix, which is accepted too.
Medusa repeats one block object L times (`[ResBlock(...)] * L`), so blocks j of a head hold equal tensors.
A head without its output layer uses the target's (`"shared_lm_head": true` in config.json: what
`specserve distill --method medusa` writes, so a trained head holds only its residual blocks).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from pipeline.models.llama import FINAL_NORMED

CONFIG_KEYS = ("medusa_num_heads", "medusa_num_layers")


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int  # K: tokens drafted per pass at most
    num_layers: int = 1  # residual blocks per head
    shared_lm_head: bool = False  # heads use the target's output layer (no per-head output layer stored)

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(f"medusa_num_heads must be >= 1 and medusa_num_layers >= 0, got "
                             f"{self.num_heads}, {self.num_layers}")

    def to_hf(self) -> dict:
        return {"medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
                "shared_lm_head": self.shared_lm_head}


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., C] -> [..., C]
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads over one hidden size; `lm_head` None: every head shares the target's output matrix `shared`."""

    feature_layers = (FINAL_NORMED,)

    def __init__(self, cfg: MedusaConfig, hidden: int, vocab: int, shared: torch.Tensor | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(nn.Sequential(*(ResBlock(hidden) for _ in range(cfg.num_layers)))
                                    for _ in range(cfg.num_heads))
        if cfg.shared_lm_head:
            assert shared is not None and shared.shape[1] == hidden, "a shared output layer needs the target's [V, C]"
            self.lm_heads = None
            self.register_buffer("shared", shared, persistent=False)
        else:
            self.lm_heads = nn.ModuleList(nn.Linear(hidden, vocab, bias=False) for _ in range(cfg.num_heads))
            self.shared = None

    @property
    def num_heads(self) -> int:
        return self.cfg.num_heads

    def hidden(self, feature: torch.Tensor) -> torch.Tensor:  # [N, C] -> [N, K, C] each head's last block output
        return torch.stack([b(feature) for b in self.blocks], dim=-2)

    def logits(self, hidden: torch.Tensor, head: int | None = None) -> torch.Tensor:
        """[N, K, C] -> [N, K, V] float32 (or one head's [N, C] -> [N, V])."""
        if head is not None:
            w = self.shared if self.lm_heads is None else self.lm_heads[head].weight
            return F.linear(hidden, w.to(hidden.dtype)).float()
        return torch.stack([self.logits(hidden[..., i, :], i) for i in range(self.num_heads)], dim=-2)

    def forward(self, feature: torch.Tensor) -> torch.Tensor:  # [N, C] -> [N, K, V] float32
        return self.logits(self.hidden(feature))

    # -- checkpoints -------------------------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Medusa's tensor names (one copy per block index, as Medusa's repeated block writes them)."""
        out = {}
        for i, seq in enumerate(self.blocks):
            for j, block in enumerate(seq):
                out[f"medusa_head.{i}.{j}.linear.weight"] = block.linear.weight
                out[f"medusa_head.{i}.{j}.linear.bias"] = block.linear.bias
            if self.lm_heads is not None:
                out[f"medusa_head.{i}.{self.cfg.num_layers}.weight"] = self.lm_heads[i].weight
        return out


def save_medusa(heads: MedusaHeads, folder: str | Path, dtype: torch.dtype = torch.bfloat16,
                meta: dict | None = None) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in heads.hf_state_dict().items()}
    save_file(state, str(folder / "medusa_lm_head.safetensors"))
    (folder / "config.json").write_text(json.dumps({**heads.cfg.to_hf(), **(meta or {})}, indent=2) + "\n")


def is_medusa_folder(folder: Path) -> bool:
    cfg = folder / "config.json"
    return cfg.exists() and all(k in json.loads(cfg.read_text()) for k in CONFIG_KEYS)


def _read_state(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if not files and (folder / "medusa_lm_head.pt").exists():
        state = torch.load(folder / "medusa_lm_head.pt", map_location="cpu", weights_only=True)
    if not state:
        raise ValueError(f"{folder}: no Medusa weights (medusa_lm_head.safetensors, *.safetensors or "
                         "medusa_lm_head.pt)")
    return {k.removeprefix("medusa_head."): v for k, v in state.items()}


def load_medusa(folder: str | Path, target_output: torch.Tensor, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> MedusaHeads:
    """Medusa heads from a checkpoint folder; `target_output` [V, C] is the target's output matrix (the shapes
    are checked against it, and heads without their own output layer use it)."""
    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    missing = [k for k in CONFIG_KEYS if k not in raw]
    if missing:
        raise ValueError(f"{folder}/config.json lacks {missing}: not a Medusa checkpoint")
    state = _read_state(folder)
    K, L = int(raw["medusa_num_heads"]), int(raw["medusa_num_layers"])
    shared = bool(raw.get("shared_lm_head", False)) or f"0.{L}.weight" not in state
    cfg = MedusaConfig(K, L, shared)
    V, C = target_output.shape
    heads = MedusaHeads(cfg, C, V, target_output.to(device, dtype) if shared else None)
    local: dict[str, torch.Tensor] = {}
    for i in range(K):
        for j in range(L):
            for p in ("weight", "bias"):
                local[f"blocks.{i}.{j}.linear.{p}"] = state[f"{i}.{j}.linear.{p}"]
        if not shared:
            local[f"lm_heads.{i}.weight"] = state[f"{i}.{L}.weight"]
    for name, t in local.items():
        want = heads.get_parameter(name).shape
        if t.shape != want:
            raise ValueError(f"{folder}: {name} has shape {tuple(t.shape)}, the target needs {tuple(want)}")
    heads.load_state_dict(local, strict=False)
    return heads.to(device=device, dtype=dtype).eval().requires_grad_(False)
