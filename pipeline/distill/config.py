"""What `specserve distill` does, as one dataclass (the CLI fills it; tests build small ones)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class DistillConfig:
    target: str  # target model: HF folder, .gguf file, or None/demo name via the model store
    out: str  # output folder: data shards, checkpoint, final drafter (HF format), metrics.json
    prompts: str | None = None  # .jsonl(.gz) chats or .npz token ids (ops/distill/build_prompts.py); None: synthetic
    eval_prompts: str | None = None  # e.g. spec_bench_dev.jsonl: evaluated on, never trained on
    heldout_prompts: int = 256  # prompts kept out of training (same distribution) for a held-out acceptance
    eval_limit: int = 0  # evaluate on the first N evaluation prompts only; 0: all

    # What to train: "model" (a separate draft model, below), "eagle3" (an EAGLE-3 head on three of the target's
    # hidden states, pipeline/heads/eagle3.py) or "medusa" (Medusa heads on its last hidden state).
    method: str = "model"
    head_depth: int = 4  # eagle3: drafts per pass it trains for (training-time test depth)
    aux_layers: tuple[int, ...] | None = None  # eagle3: target layers whose input states it fuses; None: (2, n//2, n-3)
    medusa_heads: int = 4  # medusa: heads (tokens drafted per pass at most)
    medusa_layers: int = 1  # medusa: residual blocks per head

    # Drafter shape. One run can train several variants side by side on the same target labels
    # (the target's forward is most of the cost); the first listed is exported as the drafter unless
    # `select` picks by measured acceptance per cost.
    layers: tuple[int, ...] = (2,)  # decoder layers per variant
    init_layers: str = "first"  # "first": copy the target's first L layers; "spread": evenly spaced; "random"
    hidden: int | None = None  # None: the target's width (embeddings/layers initialised from the target)
    draft_vocab: int = 8192  # output rows (frequency-ranked target tokens); 0: the target's full vocabulary
    init_from: str | None = None  # a drafter folder to start from (its draft vocabulary is kept)
    select: str = "speedup"  # "first" | "speedup" (accepted tokens per pass / (1 + K * cost ratio))

    # Data: the target's own continuations.
    gen_tokens: int = 2_000_000  # stop generating once this many response tokens exist
    gen_seconds: float | None = None  # or once this much wall time was spent generating
    max_new_tokens: int = 256
    sample_fraction: float = 0.3  # prompts answered by sampling (T=sample_temperature); the rest greedily
    sample_temperature: float = 0.7
    gen_batch_tokens: int = 1 << 20  # batch rows x (prompt + max_new_tokens) per generate call
    gen_max_batch: int = 1024
    chunk_prompts: int = 4096  # prompts per data shard (the unit of resumption)
    max_prompt_tokens: int = 1536  # longer prompts are dropped
    # Generation backend. "runner": this project's runner with continuous batching (pipeline/distill/fastgen.py;
    # the evaluation references use its eager path in eval_dtype); "hf": transformers' batched generate (the
    # two gen_batch_tokens / gen_max_batch settings above apply to it only).
    gen_backend: str = "runner"
    gen_rows: int = 512  # runner: requests decoding together (one KV-cache slot each)
    gen_refill: int = 0  # runner: refill free slots once this many are free (0: gen_rows // 8)
    gen_graphs: bool | None = None  # runner: captured static decoding steps (GraphCausalLM); None: on CUDA
    gen_compile: bool | None = None  # runner: torch.compile inside the static step; None: on CUDA
    gen_attention: str = "auto"  # runner, static step: "auto" | "triton" | "sdpa" (GraphConfig.attention)
    # Wall-clock limit for the whole run (seconds from the start of distill()): the data budget shrinks to leave
    # train_seconds + wall_reserve, and training (with train_seconds set) gets whatever is left then minus
    # `wall_reserve` (kept for the final evaluation and export).
    wall_seconds: float | None = None
    wall_reserve: float = 30.0

    # Training.
    steps: int = 2000
    train_seconds: float | None = None  # if set: measure throughput, then fix `steps` to fit this budget
    batch_tokens: int = 65536  # padded tokens per optimizer step
    max_seq_len: int = 2048  # longer samples are cut from the left (the response is kept)
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    prompt_weight: float = 0.1  # loss weight of prompt positions (response positions weigh 1)
    hard_weight: float = 0.0  # extra cross-entropy on the target's argmax token (0: pure KL)
    eval_every: int = 250
    ckpt_every: int = 250
    # Feature heads (eagle3, medusa): the target's features and top-k teacher of every batch are computed once and
    # cached (pipeline/distill/head_features.py).
    teacher_topk: int = 32  # teacher entries kept per position (renormalised over them)
    cache_gb: float | None = None  # on the training device; None: CUDA's free memory less 24 GiB, or 8 on a CPU
    host_cache_gb: float = 48.0  # then in pinned host memory (CUDA only); beyond both, recomputed each epoch
    log_every: int = 25  # steps between host reads of the training metrics (no per-step device sync)

    # Evaluation.
    eval_k: int = 4  # draft length K for acceptance figures
    eval_max_new_tokens: int = 128
    eval_temperature: float = 0.7  # the sampled evaluation (besides greedy)
    draft_top_k: int = 64  # the draft ships its top-k probabilities (as the engine does)

    device: str = "cuda"
    dtype: str = "bfloat16"  # target + autocast dtype for generation and training
    eval_dtype: str = "float32"  # target dtype when writing the evaluation references
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.layers = tuple(int(x) for x in self.layers)
        if not self.layers or min(self.layers) < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        if self.method not in ("model", "eagle3", "medusa"):
            raise ValueError(f"method must be model, eagle3 or medusa, got {self.method!r}")
        if self.head_depth < 1 or self.medusa_heads < 1 or self.medusa_layers < 0:
            raise ValueError(f"need head_depth >= 1, medusa_heads >= 1, medusa_layers >= 0, got {self.head_depth}, "
                             f"{self.medusa_heads}, {self.medusa_layers}")
        if self.aux_layers is not None:
            self.aux_layers = tuple(int(x) for x in self.aux_layers)
            if len(self.aux_layers) != 3:
                raise ValueError(f"aux_layers names three target layers, got {self.aux_layers}")
        if self.init_layers not in ("first", "spread", "random"):
            raise ValueError(f"init_layers must be first, spread or random, got {self.init_layers!r}")
        if self.select not in ("first", "speedup"):
            raise ValueError(f"select must be first or speedup, got {self.select!r}")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be >= 0, got {self.draft_vocab}")
        if not 0.0 <= self.sample_fraction <= 1.0:
            raise ValueError(f"sample_fraction must be in [0, 1], got {self.sample_fraction}")
        if self.gen_backend not in ("runner", "hf"):
            raise ValueError(f"gen_backend must be runner or hf, got {self.gen_backend!r}")
        if self.gen_rows < 1:
            raise ValueError(f"gen_rows must be >= 1, got {self.gen_rows}")
        if self.teacher_topk < 1 or self.log_every < 1:
            raise ValueError(f"teacher_topk and log_every must be >= 1, got {self.teacher_topk}, {self.log_every}")
        if self.batch_tokens < self.max_seq_len:
            raise ValueError(f"batch_tokens ({self.batch_tokens}) must be >= max_seq_len ({self.max_seq_len})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
