"""Tensor parallelism for the Llama runner: shard a `Transformer` in place over a process group, load only
this rank's slices of the weights, and let rank 0 drive the other ranks. Pure torch (torch.distributed).

The split (Megatron; gpt-fast's tp.py), rank r of N:
- attention: wq, wk, wv column-parallel by heads (a rank holds whole GQA groups: its query heads and the KV
  heads they read), wo row-parallel, then all_reduce.
- MLP: w1, w3 column-parallel, w2 row-parallel, then all_reduce.
- output layer: vocabulary-parallel: each rank computes its vocabulary slice of the logits, then all_gather. For
  an 8B model at N=4 a replicated output layer would add a quarter to every rank's weight reads per step.
- embedding: replicated on GPUs (`replicate_embedding`, the default where the model is on CUDA): a lookup reads
  one row per token, so holding the whole table costs memory (0.8 GB more a rank for an 8B model at N=4) but no
  step time, and the step needs no collective before its first layer. Otherwise vocabulary-parallel: each rank
  looks up the rows it holds (zeros for other ids), then all_reduce.
- norms and RoPE: replicated. Row-parallel biases live on rank 0 only (added once by the all_reduce).
The KV cache of a rank holds only its KV heads: the runner's `args` describe the local shard (n_heads,
n_kv_heads, intermediate_size), so `allocate` and the static graph path size everything per rank.

Heads: KV heads are dealt out in contiguous whole groups (uneven when N does not divide them: SmolLM2's 3 KV
heads over 2 ranks become 2 + 1 groups). With fewer KV heads than ranks, each KV head is replicated on N/Hkv
ranks that split its query heads evenly; anything else is refused with the reason.

Two ways to run a sharded runner:
- SPMD (torchrun, benchmarks): every rank calls `forward` with the same inputs.
- driven (serving): rank 0 wraps its runner in `TensorParallelRunner` (a `CausalLM`); every call is sent to
  the other ranks over the control channel (`tp_control`: a Unix socket to each rank on one host, else a gloo
  broadcast), where `follow()` replays it. Rank 0 alone returns logits. A failed send or collective breaks the
  group for good (`TensorParallelError`); idle followers get heartbeats, so a lost rank 0 is noticed within the
  control timeout, and a dead peer's closed socket is noticed at once.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline.models.base import ModelInfo, warmup
from pipeline.models.families import ACTIVATIONS, Family
from pipeline.models.llama import LlamaArgs, LlamaCausalLM, Transformer, hf_to_local, safetensors_files

log = logging.getLogger(__name__)

# Group sizes at which allreduce="auto" takes the fused layer's own all-reduce (pipeline.models.tp_fused) on the
# graph path. Batch-1 decode, fused against the one-shot symmetric-memory kernel: 8B at TP=2, 3.71 vs 4.33 ms on
# 2 H100s; 8B at TP=4, 2.81 vs 4.06 ms, and 70B at TP=4, 15.3 vs 19.0 ms, on 4 H100s (docs/benchmarks.md;
# "fused" is 7-16% faster than in those runs). On H200s the comparison was last made with the launch-alone
# tuner (`kernel_timing`), where fused was 31% slower at TP=4. Other sizes (never measured on 8 GPUs) keep "symm".
FUSED_AUTO_RANKS = (2, 4)

# ----------------------------------------------------------------------------------------------------
# The plan: which heads, MLP columns and vocabulary rows a rank holds (pure functions)


def even_split(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of each part; sizes differ by at most one, larger parts last."""
    return [(r * n // parts, (r + 1) * n // parts) for r in range(parts)]


def head_partition(n_heads: int, n_kv_heads: int, world_size: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Per rank ((q_start, q_end), (kv_start, kv_end)) such that the rank's query heads read exactly its KV
    heads, in the uniform GQA layout (local n_heads a multiple of local n_kv_heads)."""
    N = world_size
    assert n_heads % n_kv_heads == 0, f"n_heads {n_heads} must be a multiple of n_kv_heads {n_kv_heads}"
    group = n_heads // n_kv_heads
    if n_kv_heads >= N:  # whole groups per rank
        return [((ks * group, ke * group), (ks, ke)) for ks, ke in even_split(n_kv_heads, N)]
    copies = N // n_kv_heads  # ranks per KV head
    if N % n_kv_heads or group % copies:
        raise ValueError(
            f"tensor_parallel_size={N} does not fit {n_heads} attention heads / {n_kv_heads} KV heads: with fewer KV "
            f"heads than ranks, tensor_parallel_size must be a multiple of the KV heads and each KV head's "
            f"{group} query heads must split evenly over its {N / n_kv_heads:g} ranks"
        )
    per = group // copies
    out = []
    for r in range(N):
        kv, c = divmod(r, copies)
        q0 = kv * group + c * per
        out.append(((q0, q0 + per), (kv, kv + 1)))
    return out


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    world_size: int
    q_heads: tuple[int, int]  # [start, end) query heads of this rank
    kv_heads: tuple[int, int]  # [start, end) KV heads of this rank (may be shared with other ranks)
    ffn: tuple[int, int]  # [start, end) MLP intermediate columns
    vocab: tuple[int, int]  # [start, end) vocabulary rows held (end - start may be < vocab_shard on the last rank)
    vocab_shard: int  # rows per rank after zero padding (equal on every rank: all_gather needs equal sizes)
    head_dim: int
    replicate_embedding: bool = False  # the whole embedding table on every rank (else its `vocab` rows)

    @property
    def n_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def ffn_size(self) -> int:
        return self.ffn[1] - self.ffn[0]


def make_plan(args: LlamaArgs, rank: int, world_size: int, replicate_embedding: bool = False) -> ShardPlan:
    assert 0 <= rank < world_size, f"rank {rank} not in [0, {world_size})"
    q, kv = head_partition(args.n_heads, args.n_kv_heads, world_size)[rank]
    vs = -(-args.vocab_size // world_size)
    return ShardPlan(
        rank=rank, world_size=world_size, q_heads=q, kv_heads=kv,
        ffn=even_split(args.intermediate_size, world_size)[rank],
        vocab=(min(rank * vs, args.vocab_size), min((rank + 1) * vs, args.vocab_size)), vocab_shard=vs,
        head_dim=args.head_dim, replicate_embedding=replicate_embedding,
    )


def local_args(args: LlamaArgs, plan: ShardPlan) -> LlamaArgs:
    """The args of this rank's shard (what the runner and the static graph path size tensors by)."""
    return dataclasses.replace(args, n_heads=plan.n_heads, n_kv_heads=plan.n_kv_heads,
                               intermediate_size=plan.ffn_size)


@dataclass(frozen=True)
class Slice:
    """What a rank holds of one full tensor: `full` (replicated), `zeros` (row-parallel bias off rank 0), or
    [start, end) along `dim`, zero-padded to `pad_to` rows."""

    dim: Optional[int] = None  # None: the whole tensor
    start: int = 0
    end: int = 0
    pad_to: Optional[int] = None
    zeros: bool = False

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full tensor (tests, random-weight benchmarks)."""
        if self.zeros:
            return torch.zeros_like(full)
        if self.dim is None:
            return full
        return self.pad(full.narrow(self.dim, self.start, self.end - self.start))

    def pad(self, part: torch.Tensor) -> torch.Tensor:
        if self.pad_to is None or part.shape[0] == self.pad_to:
            return part
        out = part.new_zeros((self.pad_to, *part.shape[1:]))
        out[: part.shape[0]] = part
        return out

    def shape(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.dim is None or self.zeros:
            return tuple(full_shape)
        s = list(full_shape)
        s[self.dim] = self.pad_to if self.pad_to is not None else self.end - self.start
        return tuple(s)


_COLUMN = {"attention.wq": "q", "attention.wk": "kv", "attention.wv": "kv", "feed_forward.w1": "ffn",
           "feed_forward.w3": "ffn"}
_ROW = {"attention.wo": "q", "feed_forward.w2": "ffn"}
_PARAM = re.compile(r"^layers\.\d+\.(\w+\.\w+)\.(weight|bias)$")


def shard_slice(name: str, plan: ShardPlan) -> Slice:
    """The slice of the full (local-name) parameter `name` that this rank holds."""
    if name == "tok_embeddings.weight" and plan.replicate_embedding:
        return Slice()
    if name in ("tok_embeddings.weight", "output.weight"):
        return Slice(0, *plan.vocab, pad_to=plan.vocab_shard)
    m = _PARAM.match(name)
    if m is None:
        return Slice()  # norms
    module, kind = m.groups()
    ranges = {"q": plan.q_heads, "kv": plan.kv_heads, "ffn": plan.ffn}
    unit = {"q": plan.head_dim, "kv": plan.head_dim, "ffn": 1}
    if module in _COLUMN:
        part = _COLUMN[module]
        return Slice(0, ranges[part][0] * unit[part], ranges[part][1] * unit[part])
    if module in _ROW:
        part = _ROW[module]
        if kind == "bias":
            return Slice() if plan.rank == 0 else Slice(zeros=True)
        return Slice(1, ranges[part][0] * unit[part], ranges[part][1] * unit[part])
    return Slice()


# ----------------------------------------------------------------------------------------------------
# Collectives and the vocabulary-parallel modules


def all_reduce_(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum over the ranks, in place (one NCCL/gloo call; capturable in a CUDA graph)."""
    dist.all_reduce(x, group=group)
    return x


def gather_vocab(local: torch.Tensor, vocab_size: int, group: Any) -> torch.Tensor:
    """[..., vocab_shard] slices of every rank -> [..., vocab_size] (padding rows dropped)."""
    n = dist.get_world_size(group)
    out = local.new_empty((n * local.shape[0], *local.shape[1:]))  # ranks concatenated along dim 0
    dist.all_gather_into_tensor(out, local.contiguous(), group=group)
    return out.view(n, *local.shape).movedim(0, -2).reshape(*local.shape[:-1], n * local.shape[-1])[..., :vocab_size]


class VocabParallelEmbedding(nn.Module):
    def __init__(self, rows: int, dim: int, vocab_start: int, group: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim), requires_grad=False)  # [vocab_shard, C]
        self.vocab_start, self.group = vocab_start, group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, C]
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])  # [B, T]
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return all_reduce_(x.masked_fill_(outside[..., None], 0), self.group)


class VocabParallelOutput(nn.Module):
    def __init__(self, rows: int, dim: int, vocab_size: int, group: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim), requires_grad=False)  # [vocab_shard, C]
        self.vocab_size, self.group = vocab_size, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C] -> [B, T, V]
        return gather_vocab(F.linear(x, self.weight), self.vocab_size, self.group)


def _linear(like: nn.Linear, in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=like.bias is not None, device="meta")


def _all_reduce_output(module: nn.Module, group: Any) -> None:
    module.register_forward_hook(lambda _m, _inputs, out: all_reduce_(out, group))


def shard_modules_(model: Transformer, plan: ShardPlan, group: Any) -> None:
    """Give `model` this rank's module shapes and collectives, in place. Parameters become meta placeholders
    of the local shapes: fill them with `load_state_dict(..., assign=True)`."""
    a, D = model.args, plan.head_dim
    for layer in model.layers:
        at, ff = layer.attention, layer.feed_forward
        at.n_heads, at.n_kv_heads = plan.n_heads, plan.n_kv_heads
        at.wq = _linear(at.wq, a.dim, plan.n_heads * D)
        at.wk = _linear(at.wk, a.dim, plan.n_kv_heads * D)
        at.wv = _linear(at.wv, a.dim, plan.n_kv_heads * D)
        at.wo = _linear(at.wo, plan.n_heads * D, a.dim)
        _all_reduce_output(at.wo, group)
        ff.w1 = _linear(ff.w1, a.dim, plan.ffn_size)
        ff.w3 = _linear(ff.w3, a.dim, plan.ffn_size)
        ff.w2 = _linear(ff.w2, plan.ffn_size, a.dim)
        _all_reduce_output(ff.w2, group)
    with torch.device("meta"):
        if not plan.replicate_embedding:  # else the model's own nn.Embedding, holding every row
            model.tok_embeddings = VocabParallelEmbedding(plan.vocab_shard, a.dim, plan.vocab[0], group)
        model.output = VocabParallelOutput(plan.vocab_shard, a.dim, a.vocab_size, group)


# A source of weights: (local parameter name, full shape, slice) -> this rank's tensor (any device/dtype).
TensorSource = Callable[[str, tuple[int, ...], Slice], torch.Tensor]


def build_sharded_transformer(
    args: LlamaArgs, plan: ShardPlan, group: Any, source: TensorSource,
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
) -> Transformer:
    """This rank's shard of the model, every parameter read from `source` one at a time. Tied embeddings: the
    output layer is the embedding's own rows (a view; with a replicated embedding, its vocabulary slice)."""
    with torch.device("meta"):
        model = Transformer(args)
    full_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shard_modules_(model, plan, group)
    state = {}
    for name, full_shape in full_shapes.items():
        if args.tie_embeddings and name == "output.weight":
            continue
        sl = shard_slice(name, plan)
        t = source(name, full_shape, sl)
        want = sl.shape(full_shape)
        assert tuple(t.shape) == want, f"{name}: shard shape {tuple(t.shape)} != expected {want}"
        state[name] = t.to(device=device, dtype=dtype)
    tied_view = args.tie_embeddings and not plan.replicate_embedding
    if args.tie_embeddings:
        embedding = state["tok_embeddings.weight"]
        state["output.weight"] = embedding if tied_view else shard_slice("output.weight", plan).take(embedding)
    model.load_state_dict(state, strict=True, assign=True)
    if tied_view:
        model.output.weight = model.tok_embeddings.weight
    model.shard_plan = plan
    return model.eval().requires_grad_(False)


def safetensors_source(folder: Path, stats: Optional[dict] = None, family: Family = Family()) -> TensorSource:
    """Reads only the requested slice of each tensor (`safe_open(...).get_slice`). `stats["elements"]`
    counts the elements read. `family`: the model's (it names some tensors its own way)."""
    from safetensors import safe_open

    where: dict[str, tuple[Path, str]] = {}  # local name -> (file, HF name)
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                local = hf_to_local(hf_name, family)
                if local is not None:
                    where[local] = (file, hf_name)

    def read(name: str, full_shape: tuple[int, ...], sl: Slice) -> torch.Tensor:
        if name not in where:
            raise ValueError(f"weights missing from {folder}: {name}")
        file, hf_name = where[name]
        if sl.zeros:
            return torch.zeros(full_shape)
        with safe_open(str(file), framework="pt", device="cpu") as f:
            part = f.get_slice(hf_name)
            shape = tuple(part.get_shape())
            assert shape == full_shape, f"{hf_name}: shape {shape} != expected {full_shape}"
            if sl.dim is None:
                t = part[:]
            elif sl.dim == 0:
                t = part[sl.start:sl.end]
            else:
                t = part[:, sl.start:sl.end]
        if stats is not None:
            stats["elements"] = stats.get("elements", 0) + t.numel()
        return sl.pad(t) if sl.dim is not None else t

    return read


def num_parameters(args: LlamaArgs) -> int:
    """Parameters of the whole (unsharded) model, tied embeddings counted once."""
    C, D, I = args.dim, args.head_dim, args.intermediate_size
    q, kv = args.n_heads * D, args.n_kv_heads * D
    layer = C * (q + 2 * kv) + q * C + 3 * C * I + 2 * C
    layer += (q + 2 * kv) * args.qkv_bias + C * args.o_bias + (2 * I + C) * args.mlp_bias
    layer += 2 * D * args.family.qk_norm + 2 * C * args.family.sandwich_norms
    return args.n_layers * layer + C + args.vocab_size * C * (1 if args.tie_embeddings else 2)


# ----------------------------------------------------------------------------------------------------
# Process groups


@dataclass(frozen=True)
class TPContext:
    rank: int
    world_size: int
    device: torch.device
    group: Any  # compute group (NCCL on CUDA, gloo on CPU); None: the default group
    control: Any  # gloo group: sets up rank 0's control channel (`tp_control`), and is its fallback
    control_timeout_s: float = 30.0  # a follower waiting longer than this for rank 0's next message gives up


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, device: torch.device | str = "cpu",
    collective_timeout_s: float = 60.0, control_timeout_s: float = 30.0,
) -> TPContext:
    """Join (or start, on rank 0) the group at `init_method` ("tcp://host:port"). Collectives that wait longer
    than their timeout raise (gloo) or abort the process (NCCL watchdog) instead of hanging."""
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=collective_timeout_s), **kw)
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=control_timeout_s))
    return TPContext(rank, world_size, device, None, control, control_timeout_s)


def load_tensor_parallel_model(
    path: str | Path | None, tp: TPContext, dtype: str | torch.dtype = "float32", stats: Optional[dict] = None,
    replicate_embedding: Optional[bool] = None,
) -> LlamaCausalLM:
    """This rank's `LlamaCausalLM` over its shard, reading only its slices from the folder's safetensors (and the
    whole embedding table where it is replicated: by default on CUDA, see the module doc). Its `args` are the
    local shard's; `info` describes the whole model. Call `allocate()` before use."""
    import json

    from pipeline.models.llama import unsupported_reason
    from pipeline.models.loader import _max_positions, eos_token_ids, load_tokenizer, model_folder, parse_dtype

    folder = model_folder(path)
    config = json.loads((folder / "config.json").read_text())
    reason = unsupported_reason(config)
    if reason is None and not any(folder.glob("*.safetensors")):
        reason = "no *.safetensors weights"
    if reason is not None:
        raise ValueError(f"tensor parallelism needs the Llama fast path; {folder.name}: {reason}")
    args = LlamaArgs.from_hf(config)
    if replicate_embedding is None:
        replicate_embedding = torch.device(tp.device).type == "cuda"
    plan = make_plan(args, tp.rank, tp.world_size, replicate_embedding)
    model = build_sharded_transformer(args, plan, tp.group, safetensors_source(folder, stats, args.family),
                                      tp.device, parse_dtype(dtype))
    tokenizer = load_tokenizer(folder) if tp.rank == 0 else None  # its EOS id joins info.eos_token_ids
    info = ModelInfo(
        name=folder.name, path=str(folder), vocab_size=args.vocab_size,
        eos_token_ids=eos_token_ids(folder, config, tokenizer), max_position_embeddings=_max_positions(config),
        architecture=(config.get("architectures") or ["LlamaForCausalLM"])[0],
        num_parameters=num_parameters(args), fast_path=True,
    )
    return sharded_runner(model, info)


def sharded_runner(model: Transformer, info: ModelInfo) -> LlamaCausalLM:
    runner = LlamaCausalLM(model, info)
    runner.args = local_args(model.args, model.shard_plan)  # the KV cache holds only this rank's heads
    return runner


# ----------------------------------------------------------------------------------------------------
# Driving the followers: rank 0's calls are replayed on every rank

_NOOP, _FORWARD, _ALLOCATE, _STOP, _WARMUP = 0, 1, 2, 3, 4  # op, the header's first field (tp_control.HEADER)


class TensorParallelError(RuntimeError):
    """The group is broken (a rank is lost, a collective failed or timed out): this replica must go."""


class TensorParallelRunner:
    """`CausalLM` on rank 0 over a sharded runner whose copies on the other ranks run `follow()`.

    Construction waits (barrier) for the followers to enter `follow()`, then opens the control channel with them
    (`tp_control.open_control`; `control`: "auto", the default, takes a Unix socket to each follower on this host,
    else gloo broadcasts; "socket" or "gloo" force one; `spin_ms`: how long followers poll for the next message
    before they block, default None: `tp_control.DEFAULT_SPIN_MS` (20) on GPUs, 0 on CPU). Every
    `allocate`/`forward` is first sent to the followers (one message: a header and the int64 inputs), then run on
    every rank. Inputs are checked here first, so a bad call fails on rank 0 alone and never desynchronises the
    group. `heartbeat_s`: idle followers get a no-op this often (keep it well below the control timeout).
    `on_failure(err)` runs once when the group breaks (serving: exit the process).
    """

    def __init__(self, runner: Any, tp: TPContext, heartbeat_s: Optional[float] = 5.0,
                 on_failure: Optional[Callable[[BaseException], None]] = None, control: str = "auto",
                 spin_ms: Optional[float] = None) -> None:
        from pipeline.models.tp_control import open_control

        assert tp.rank == 0, "TensorParallelRunner runs on rank 0; the other ranks call follow()"
        self.runner, self.tp, self.info = runner, tp, runner.info
        self.on_failure = on_failure
        self.broken: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._closed = False
        self.heartbeat_s = heartbeat_s
        dist.barrier(group=tp.group)  # followers are in follow(): startup skew is not held to the control timeout
        if spin_ms is None and tp.device.type != "cuda":
            spin_ms = 0.0  # CPU ranks compute on every core: a polling follower would slow them
        self.channel = open_control(0, tp.world_size, tp.control, control, tp.control_timeout_s, spin_ms)
        self.control = self.channel.kind
        if heartbeat_s:
            threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True).start()

    @property
    def num_slots(self) -> int:
        return self.runner.num_slots

    @property
    def max_len(self) -> int:
        return self.runner.max_len

    def cache_bytes(self) -> int:
        return self.runner.cache_bytes()

    def allocate(self, num_slots: int, max_len: int) -> None:
        assert num_slots >= 1 and max_len >= 1, f"need num_slots, max_len >= 1, got {num_slots}, {max_len}"
        self._run([_ALLOCATE, 0, 0, 0, num_slots, max_len], None, lambda: self.runner.allocate(num_slots, max_len))

    def warmup(self, max_batch: int, max_tokens: int | None = None) -> int:
        """Every rank captures its step graphs now, in lockstep (`GraphCausalLM.warmup`; max_tokens None: every
        token bucket); 0 where the sharded runner has no graphs."""
        assert max_batch >= 1 and (max_tokens is None or max_tokens >= 1), (max_batch, max_tokens)
        return self._run([_WARMUP, 0, 0, 0, max_batch, max_tokens or 0], None,
                         lambda: warmup(self.runner, max_batch, max_tokens))

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor,  # [B] int64
        slots: torch.Tensor,  # [B] int64
        logits_from: int = 0,
    ) -> torch.Tensor:  # [B, T - logits_from, V] float32
        tokens, positions, slots = (t.to("cpu", torch.int64) for t in (tokens, positions, slots))
        assert tokens.dim() == 2, f"tokens must be [B, T], got {tuple(tokens.shape)}"
        B, T = tokens.shape
        assert B >= 1, "a call needs at least one row"
        assert positions.shape == (B,) and slots.shape == (B,), (
            f"positions {tuple(positions.shape)} and slots {tuple(slots.shape)} must be [B={B}]")
        assert 0 <= logits_from < T, f"logits_from must be in [0, {T}), got {logits_from}"
        ids, pos, sl = tokens.reshape(-1).tolist(), positions.tolist(), slots.tolist()  # checks on lists: a few us
        assert min(pos) >= 0 and max(pos) + T <= self.max_len, f"positions + T must lie in [0, max_len={self.max_len}]"
        assert min(sl) >= 0 and max(sl) < self.num_slots and len(set(sl)) == B, (
            f"slots must be distinct and in [0, {self.num_slots})")
        assert min(ids) >= 0 and max(ids) < self.info.vocab_size, f"token ids must lie in [0, {self.info.vocab_size})"
        return self._run([_FORWARD, B, T, logits_from, 0, 0], ids + pos + sl,
                         lambda: self.runner.forward(tokens, positions, slots, logits_from))

    __call__ = forward

    def close(self) -> None:
        """Release the followers (their `follow()` returns)."""
        with self._lock:
            if not self._closed and self.broken is None:
                self._closed = True
                self._send([_STOP, 0, 0, 0, 0, 0])
                self.channel.close()

    def _run(self, header: list[int], payload: Optional[list[int]], call: Callable[[], Any]) -> Any:
        with self._lock:
            if self.broken is not None or self._closed:
                raise TensorParallelError(f"tensor-parallel group is {'closed' if self._closed else 'broken'}") \
                    from self.broken
            try:
                self._send(header, payload or ())
                return call()
            except Exception as err:  # noqa: BLE001 - any failure mid-call leaves the ranks out of step
                self._fail(err)
                raise TensorParallelError(f"tensor-parallel step failed: {err}") from err

    def _send(self, header: list[int], payload: Sequence[int] = ()) -> None:
        self.channel.send(header, payload)
        self._last_sent = time.monotonic()

    def _fail(self, err: BaseException) -> None:
        self.broken = err
        log.error("tensor-parallel group broken: %s", err)
        if self.on_failure is not None:
            self.on_failure(err)

    def _heartbeat(self) -> None:
        while True:
            time.sleep(self.heartbeat_s / 4)
            with self._lock:
                if self._closed or self.broken is not None:
                    return
                if time.monotonic() - self._last_sent < self.heartbeat_s:
                    continue
                try:
                    self._send([_NOOP, 0, 0, 0, 0, 0])
                except Exception as err:  # noqa: BLE001
                    self._fail(err)
                    return


def follow(runner: Any, tp: TPContext) -> None:
    """Ranks > 0: replay rank 0's calls on this rank's shard until rank 0 closes the group. Raises
    `TensorParallelError` when rank 0 is lost (a closed connection, or no message, heartbeats included, within
    the control timeout) or a collective fails."""
    from pipeline.models.tp_control import open_control

    assert tp.rank != 0, "rank 0 drives (TensorParallelRunner); follow() is for the other ranks"
    channel = None
    try:
        dist.barrier(group=tp.group)  # rank 0 has built its TensorParallelRunner (loading skew is not an outage)
        channel = open_control(tp.rank, tp.world_size, tp.control, None, tp.control_timeout_s)
        with torch.inference_mode():
            while True:
                (op, B, T, logits_from, a, b), payload = channel.recv()
                if op == _STOP:
                    return
                if op == _ALLOCATE:
                    runner.allocate(a, b)
                elif op == _WARMUP:
                    warmup(runner, a, b or None)
                elif op == _FORWARD:
                    assert payload is not None and payload.numel() == B * T + 2 * B, "a forward's inputs are missing"
                    runner.forward(payload[: B * T].view(B, T), payload[B * T: B * T + B], payload[B * T + B:],
                                   logits_from)
                elif op != _NOOP:  # a leader of another version: fail now rather than fall out of step later
                    raise TensorParallelError(f"unknown control message {op}")
    except Exception as err:  # noqa: BLE001
        raise TensorParallelError(f"rank {tp.rank}: tensor-parallel group lost: {err}") from err
    finally:
        if channel is not None:
            channel.close()


# ----------------------------------------------------------------------------------------------------
# The static-shape (CUDA graph) path over a sharded runner


def tensor_parallel_graphs(runner: LlamaCausalLM, config: Any = None, allreduce: str = "auto") -> Any:
    """`pipeline.models.graphs.GraphCausalLM` over a sharded runner (every rank wraps its runner the same
    way, so captures happen in lockstep). The graph path calls its attention-output/MLP math on raw weights,
    bypassing the modules' all_reduce hooks: that function is swapped for one with the two all-reduces
    (`pipeline.models.tp_allreduce`, `allreduce` = nccl | symm; the wrapper's `allreduce` attribute says what
    it resolved to). With `allreduce="fused"` the fused layer serves calls of up to 16 rows instead, pushing its
    partial sums from its linears' epilogues (`pipeline.models.tp_fused`); larger calls take the swapped math
    with the "auto" reducer. "auto": "fused" at `FUSED_AUTO_RANKS` ranks where the fused layer runs (and sets
    up), else the reducer's own "auto" (symm, else nccl). Its static logits come from the local output rows;
    they are gathered here, after the graph (one all_gather per call, straight from the graph's output; the eager
    fallback's output module gathers its own). A vocabulary-parallel embedding does its own all_reduce inside
    the graph; a replicated one (the default on GPUs) needs none. A model whose family the graph path lacks
    (`graphs.graph_path_reason`) stays the eager sharded runner, said once, on every rank alike."""
    from pipeline.models import fused_linear as fl
    from pipeline.models import graphs

    reason = graphs.graph_path_reason(runner.model.args)
    if reason is not None:
        log.warning("%s: tensor-parallel eager fast path, no static-shape graphs (%s)", runner.info.name, reason)
        return runner
    from pipeline.models.skinny_linear import linear
    from pipeline.models.tp_allreduce import ALLREDUCE_KINDS, make_reducer
    from pipeline.models.tp_fused import setup_fused_allreduce

    plan: ShardPlan = runner.model.shard_plan
    group = runner.model.output.group
    vocab_size = runner.info.vocab_size

    class TensorParallelGraphs(graphs.GraphCausalLM):
        supports_tree = False  # the ranks' lockstep protocol carries no tree parents

        def _result(self, logits: torch.Tensor) -> torch.Tensor:  # [B, T', V]: gathered from the static slice
            assert logits.shape[-1] == plan.vocab_shard, (
                f"graph path returned {logits.shape[-1]} logits per row; expected this rank's {plan.vocab_shard}")
            return gather_vocab(logits, vocab_size, group)  # a new tensor: no copy of the slice first

    g = TensorParallelGraphs(runner, config)
    kinds = ALLREDUCE_KINDS + ("fused",)
    if allreduce not in kinds:
        raise ValueError(f"allreduce must be one of {kinds}, got {allreduce!r}")
    # "fused": the fused layer pushes its partial sums to every rank from its linears' epilogues
    # (pipeline.models.tp_fused). "auto" takes it at FUSED_AUTO_RANKS ranks where the fused layer runs. Otherwise
    # the fused layer is off and the swapped math below, with an all-reduce kernel (`make_reducer`), serves every
    # call.
    if allreduce == "fused" and not g.fused_layer:
        raise ValueError("allreduce='fused' needs the fused layer: a CUDA model in bf16/fp16 with the Triton attention")
    if allreduce == "fused" and runner.args.family.sandwich_norms:
        raise ValueError("allreduce='fused' has no norms after attention and MLP (Gemma): use nccl, symm or auto")
    fused = allreduce == "fused" or (allreduce == "auto" and g.fused_layer and plan.world_size in FUSED_AUTO_RANKS
                                     and not runner.args.family.sandwich_norms)
    if fused:
        try:
            g._tp_sites = setup_fused_allreduce(group, runner.device, fl.LAYER_MAX_ROWS, runner.args.dim,
                                                2 * runner.args.n_layers, runner.dtype, g.config.tp_spin_timeout_s)
        except Exception as e:  # noqa: BLE001 - "auto" falls back (the self-test fails on every rank at once)
            if allreduce == "fused":
                raise
            log.warning("fused all-reduce unavailable (%s: %s); using the all-reduce kernel", type(e).__name__, e)
            fused = False
    if not fused:
        g.fused_layer = False  # the fused layer has no all-reduce between its linears: the swapped math below serves
    # Every call of up to 16 rows takes the fused layer, not only batch 1's: the swapped math's sums (a copy, an
    # all-reduce kernel, the residual add, twice a layer) cost more than the unfused layer gains over the fused one
    # at batch 4-16 at TP=1 (batch-8 decode at TP=2 on H100s: 4.47 -> 3.70 ms).
    g.fused_all_rows = fused

    def attn_proj(y: torch.Tensor, wo: torch.Tensor, bo: Optional[torch.Tensor], T: int, lk: str) -> torch.Tensor:
        B, Hkv, GT, D = y.shape  # [B, Hkv, G*T, D] -> [B, T, H*D] (query index g*T + t)
        y = y.view(B, Hkv, GT // T, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, -1)
        return linear(y, wo, bo, lk)  # [B, T, C] partial sum

    def mlp(x, norm_w, w13, b13, w2, b2, eps: float, lk: str, act: str = "silu", offset: bool = False) -> torch.Tensor:
        gate, up = linear(graphs.rms_norm(x, norm_w, eps, offset), w13, b13, lk).chunk(2, dim=-1)
        return linear(ACTIVATIONS[act](gate) * up, w2, b2, lk)  # [B, T, C] partial sum

    if g._attn_in is not graphs.attn_in:  # the wrapper compiles its pointwise work: compile ours too
        attn_proj, mlp = (torch.compile(f, fullgraph=True) for f in (attn_proj, mlp))

    reduce, kind = make_reducer("auto" if allreduce == "fused" else allreduce, group, runner.device, runner.dtype)
    g.allreduce = "fused" if fused else kind  # calls the fused layer does not take (past 16 rows) use `kind`

    def attn_out_mlp(x, y, wo, bo, norm_w, w13, b13, w2, b2, eps, lk: str = "torch", post_attn_norm=None,
                     post_ffn_norm=None, act: str = "silu", offset: bool = False):  # [B, T, C]; graphs.attn_out_mlp
        o = reduce(attn_proj(y, wo, bo, x.shape[1], lk))
        x = x + (o if post_attn_norm is None else graphs.rms_norm(o, post_attn_norm, eps, offset))
        h = reduce(mlp(x, norm_w, w13, b13, w2, b2, eps, lk, act, offset))
        return x + (h if post_ffn_norm is None else graphs.rms_norm(h, post_ffn_norm, eps, offset))

    assert hasattr(g, "_attn_out_mlp"), "graphs.GraphCausalLM changed: update tensor_parallel_graphs"
    g._attn_out_mlp = attn_out_mlp
    g.shard_plan = plan
    return g
