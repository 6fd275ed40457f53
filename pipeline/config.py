"""Per-request parameters of the algorithm: sampling and speculation.

Plain dataclasses, validated at construction so every caller (CLI, HTTP edge, tests) gets the same clear
message for bad input. pydantic lives only at the edges (deployments/).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

# The drafter vocabulary (CLI --draft, `SpeculativeEngine.from_pretrained(draft=...)`, Serve `drafter.draft`):
PROMPT_LOOKUP = "prompt-lookup"  # n-gram copy from the context (pipeline.drafters.PromptLookupDrafter)
SUFFIX = "suffix"  # suffix decoding over the context and earlier outputs (pipeline.suffix.SuffixDrafter)
HYBRID_PREFIX = "lookup+"  # "lookup+MODEL": prompt lookup where it matches, the model elsewhere (HybridDrafter)
NO_DRAFT = "none"  # target-only decoding (the Python API says None)
DEFAULT_DRAFT = "default"  # the target's default drafter (pipeline.engine.default_draft)
# "synthetic:ALPHA:SHAPE:RECORDING": a measurement drafter with known acceptance (pipeline.synthetic)
SYNTHETIC_PREFIX = "synthetic:"
# "medusa:DIR", "eagle3:DIR": a feature head reading the target's hidden states (pipeline.heads)
MEDUSA_PREFIX = "medusa:"
EAGLE3_PREFIX = "eagle3:"
# "self" or "self:window=W,sinks=N": the target drafts for itself through a StreamingLLM window (pipeline.self_spec)
SELF_DRAFT = "self"
# anything else names a draft model: a folder, a .gguf file or a shipped drafter's name


def is_head(spec: str | None) -> bool:
    """Whether a drafter word (or a hybrid's model part) names a feature head (`medusa:DIR`, `eagle3:DIR`)."""
    if spec is not None and spec.startswith(HYBRID_PREFIX):
        spec = spec[len(HYBRID_PREFIX):]
    return spec is not None and spec.startswith((MEDUSA_PREFIX, EAGLE3_PREFIX))


def draft_model_spec(spec: str) -> str | None:
    """The draft model a drafter spec names (for a hybrid, its model part); None for prompt lookup, suffix, none,
    the feature heads and self-speculation (they run with the target, not as a model of their own). A synthetic
    drafter's word is its own model spec (it runs where draft models run), unless its SHAPE is `self`."""
    if spec in (PROMPT_LOOKUP, SUFFIX, NO_DRAFT) or is_head(spec) or is_self(spec):
        return None
    if is_synthetic(spec) and parse_synthetic(spec).self_timed:
        return None
    return spec[len(HYBRID_PREFIX):] if spec.startswith(HYBRID_PREFIX) else spec


@dataclass(frozen=True)
class SyntheticSpec:
    """The parts of a `synthetic:ALPHA:SHAPE:RECORDING` drafter word (pipeline.synthetic)."""

    alpha: float  # probability that a drafted position is the target's own (greedy) token
    shape: str  # whose time each step spends: a name of pipeline.models.shapes.SHAPES, a folder, or `self`
    recording: str  # JSON file of the target's greedy continuations of the prompts (pipeline.synthetic.Recording)

    @property
    def self_timed(self) -> bool:
        """Whether the drafts spend self-speculation's time (the target's own windowed forwards)."""
        return self.shape == SELF_DRAFT


def is_synthetic(spec: str | None) -> bool:
    return spec is not None and spec.startswith(SYNTHETIC_PREFIX)


def parse_synthetic(spec: str) -> SyntheticSpec:
    """Split and check a synthetic drafter word; ValueError with the expected form otherwise."""
    form = f"expected '{SYNTHETIC_PREFIX}ALPHA:SHAPE:RECORDING' (e.g. '{SYNTHETIC_PREFIX}0.8:llama-1b:rec.json')"
    if not is_synthetic(spec):
        raise ValueError(f"not a synthetic drafter word: {spec!r}; {form}")
    parts = spec[len(SYNTHETIC_PREFIX):].split(":", 2)
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"bad synthetic drafter word {spec!r}: {form}")
    try:
        alpha = float(parts[0])
    except ValueError:
        raise ValueError(f"bad synthetic drafter word {spec!r}: ALPHA {parts[0]!r} is not a number") from None
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"bad synthetic drafter word {spec!r}: ALPHA must be in [0, 1], got {alpha}")
    return SyntheticSpec(alpha, parts[1], parts[2])


@dataclass(frozen=True)
class SelfSpec:
    """The StreamingLLM window of a self-speculation drafter (`self:window=W,sinks=N`, pipeline.self_spec): a draft
    step's query at position p reads the keys at positions < sinks and in (p - window, p]."""

    window: int = 512  # recent positions a draft step reads (the query's own included)
    sinks: int = 4  # attention-sink positions at the start of the context, always read

    def __post_init__(self) -> None:
        if self.window < 1 or self.sinks < 0:
            raise ValueError(f"self-speculation needs window >= 1 and sinks >= 0, got window={self.window}, "
                             f"sinks={self.sinks}")

    def word(self) -> str:
        return f"{SELF_DRAFT}:window={self.window},sinks={self.sinks}"


def is_self(spec: str | None) -> bool:
    return spec is not None and (spec == SELF_DRAFT or spec.startswith(SELF_DRAFT + ":"))


def parse_self(spec: str) -> SelfSpec:
    """`self` (defaults) or `self:window=W,sinks=N` (either key may be left out); ValueError with the form."""
    form = f"expected '{SELF_DRAFT}' or '{SELF_DRAFT}:window=W,sinks=N' (e.g. '{SELF_DRAFT}:window=512,sinks=4')"
    if not is_self(spec):
        raise ValueError(f"not a self-speculation drafter word: {spec!r}; {form}")
    values: dict[str, int] = {}
    rest = spec[len(SELF_DRAFT) + 1:]
    if spec != SELF_DRAFT and not rest:
        raise ValueError(f"bad drafter word {spec!r}: {form}")
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in ("window", "sinks") or key in values or not value.strip().isdigit():
            raise ValueError(f"bad drafter word {spec!r}: {form}")
        values[key] = int(value)
    return SelfSpec(**values)


class InvalidParam(ValueError):
    """A bad sampling or speculation parameter; `param` names it (the HTTP edge reports it as the 400's param)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn from a distribution. The draft and the target are warped the same way.

    temperature == 0 means greedy (argmax); top_k == 0 and top_p == 1.0 mean "no truncation".
    """

    temperature: float = 0.0
    top_k: int = 0  # 0: whole vocabulary
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    max_tokens: int = 128  # hard limit on generated tokens (never exceeded)
    stop: tuple[str, ...] = ()  # stop strings: output ends before the first occurrence
    seed: int | None = None  # None: a fresh random seed, reported back so the output is reproducible
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature < math.inf):  # also rejects NaN
            raise InvalidParam("temperature", f"temperature must be >= 0 (and finite), got {self.temperature}")
        if self.top_k < 0:
            raise InvalidParam("top_k", f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidParam("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise InvalidParam("max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if any(not s for s in self.stop):
            raise InvalidParam("stop", "stop strings must be non-empty")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise InvalidParam("seed", f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self) -> "SamplingParams":
        """Return a copy whose seed is fixed (drawn from the OS if absent), so the run can be replayed."""
        if self.seed is not None:
            return self
        seed = int.from_bytes(os.urandom(8), "little") & (2**62 - 1)
        return SamplingParams(**{**self.__dict__, "seed": seed})


MAX_NUM_DRAFT_TOKENS = 64  # the largest K a request may ask for (also the adaptive K policy's cap)


@dataclass(frozen=True)
class SpecParams:
    """How much to speculate. num_draft_tokens == 0 (or no drafter) is plain target decoding."""

    num_draft_tokens: int = 4  # K: tokens proposed per target pass
    draft_top_k: int = 64  # the draft ships only its top-k probabilities per position (O(K*k) on the wire)

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 0:
            raise InvalidParam("num_draft_tokens", f"K (num_draft_tokens) must be >= 0, got {self.num_draft_tokens}")
        if self.num_draft_tokens > MAX_NUM_DRAFT_TOKENS:
            raise InvalidParam("num_draft_tokens", f"K (num_draft_tokens) must be <= {MAX_NUM_DRAFT_TOKENS}, "
                               f"got {self.num_draft_tokens}")
        if self.draft_top_k < 1:
            raise InvalidParam("draft_top_k", f"draft_top_k must be >= 1, got {self.draft_top_k}")


MAX_TREE_NODES = 64  # the most nodes a token tree may have (the target's cache slack holds them)


@dataclass(frozen=True)
class TreeConfig:
    """The static shape of a token-tree draft (pipeline.tree.TreeDrafter): every node at depth d gets
    branching[d] children, the draft model's most likely tokens (greedy) or tokens drawn without replacement
    (sampled); with a node budget, the nodes whose path ranks add up least are kept. Or an explicit shape (`paths`,
    e.g. a tree of `specserve tune-tree`, `pipeline.tree_tune`): every node as its path of sibling ranks."""

    branching: tuple[int, ...] = (2, 2, 1, 1)  # children per node at each depth; its length is the tree's depth
    max_nodes: int | None = None  # node budget; None: the full tree (at most MAX_TREE_NODES nodes)
    # EAGLE-2's dynamic tree (an EAGLE-3 head, greedy batches; `pipeline.heads.drafter.eagle3_dynamic_tree`): the
    # pending token's branching[0] likeliest children, then at each depth d >= 1 every kept node of depth d - 1 gets
    # its branching[d] likeliest children, of which the branching[d] likeliest paths are kept to grow on; the
    # max_nodes likeliest paths of all drafted nodes are verified. Sampled batches draft the static shape.
    dynamic: bool = False
    # An explicit static shape: each node's path of sibling ranks from the pending token ((0,): its favourite child,
    # (0, 1): that child's second). Closed under parents, each node's children a run of ranks 0..c-1, at most
    # MAX_TREE_NODES nodes. With paths, branching is derived from them (the most children of a node at each depth;
    # its length is the tree's depth) and max_nodes and dynamic must be left out.
    paths: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.paths is not None:
            object.__setattr__(self, "paths", _check_paths(self.paths))
            if self.max_nodes is not None or self.dynamic:
                raise InvalidParam("tree", "an explicit tree shape (paths) is static and has its own node count: "
                                   "leave out max_nodes and dynamic")
            widths = [0] * max(len(p) for p in self.paths)
            for p in self.paths:
                widths[len(p) - 1] = max(widths[len(p) - 1], p[-1] + 1)
            object.__setattr__(self, "branching", tuple(widths))
        object.__setattr__(self, "branching", tuple(int(b) for b in self.branching))
        if not self.branching or min(self.branching) < 1:
            raise InvalidParam("tree", f"tree branching must be one or more counts >= 1, got {self.branching}")
        if self.dynamic and self.max_nodes is None:
            raise InvalidParam("tree", "a dynamic tree needs a node budget (max_nodes)")
        if self.max_nodes is not None and not 1 <= self.max_nodes <= MAX_TREE_NODES:
            raise InvalidParam("tree", f"tree max_nodes must be in [1, {MAX_TREE_NODES}], got {self.max_nodes}")
        if self.paths is not None:
            return
        full, width = 0, 1
        for b in self.branching:
            width *= b
            full += width
            if full > 4096:
                break
        if min(full, self.max_nodes or full) > MAX_TREE_NODES:
            raise InvalidParam("tree", f"a tree of branching {self.branching} has {full if full <= 4096 else '>4096'}"
                               f" nodes; at most {MAX_TREE_NODES} (set max_nodes)")


def _check_paths(paths) -> tuple[tuple[int, ...], ...]:
    """`TreeConfig.paths` as tuples, checked (its comment); InvalidParam naming the first fault."""
    try:
        out = tuple(tuple(int(r) for r in p) for p in paths)
    except (TypeError, ValueError):
        raise InvalidParam("tree", "tree paths must be lists of sibling ranks (integers)") from None
    kept = set(out)
    if not out or len(kept) != len(out) or len(out) > MAX_TREE_NODES:
        raise InvalidParam("tree", f"tree paths must be 1 to {MAX_TREE_NODES} distinct nodes, got {len(out)} "
                           f"({len(kept)} distinct)")
    for p in out:
        if not p or min(p) < 0:
            raise InvalidParam("tree", f"a tree path is one or more ranks >= 0, got {list(p)}")
        if len(p) > 1 and p[:-1] not in kept:
            raise InvalidParam("tree", f"tree node {list(p)} has no parent {list(p[:-1])}")
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in kept:
            raise InvalidParam("tree", f"tree node {list(p)} has no sibling of rank {p[-1] - 1} (each node's "
                               "children are ranks 0..c-1)")
    return out


@dataclass
class EngineConfig:
    """Capacity of one engine (one process holding a target and maybe a drafter)."""

    max_batch_size: int = 16  # KV-cache slots, i.e. requests held at once
    max_seq_len: int = 2048  # prompt + generated tokens per request (cache length is this + K + 1)
    device: str = "cpu"
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    graphs: bool = True  # models on CUDA run on the static-shape CUDA-graph path (pipeline.models.graphs)
    # A draft model's weights on the graph path: "model" (its own) or "fp8" (float8 copies streamed by the fused
    # layer: half the bytes; acceptance may move, the output cannot: rejection sampling keeps the target's
    # distribution).
    draft_weights: Literal["model", "fp8"] = "model"
    # A token tree instead of a chain (TreeConfig): a draft model drafts this shape, the target verifies it in one
    # pass. None: chains. Needs a draft model and a target on the eager fast path (else chains, logged).
    tree: TreeConfig | None = None
    # Run a batch whose drafter is one draft model, one feature head (medusa:/eagle3:, not behind prompt lookup) or
    # none as device work read back one step behind (pipeline.device_loop: no host read between steps; on CUDA one
    # captured graph a step). Its K is fixed (no adaptive K), and requests join only when the batch starts; other
    # batches take the step-by-step path. None: where the step can be captured (the target, and a draft model, on
    # the CUDA graph path with its device-side attention; a head runs on the target's device in plain torch ops).
    device_loop: bool | None = None
    # Self-speculation for long contexts (pipeline.self_spec): on a CUDA target with at least `self_spec_min_batch`
    # slots, requests whose prompt has at least `self_spec_min_context` tokens draft with the target itself through
    # a StreamingLLM window of its cache (the drafter word `self` asks for it everywhere). 0 turns the automatic
    # choice off. The defaults: an 8B target on an H100 (docs/configuration.md gives the estimate), where 32 streams'
    # KV cache outweighs the weights enough for the demo target's acceptance to pay from about 6k tokens.
    self_spec_min_context: int = 6144
    self_spec_min_batch: int = 32
    self_spec_window: int = 512  # recent positions a draft step reads
    self_spec_sinks: int = 4  # attention-sink positions a draft step reads

    def __post_init__(self) -> None:
        if self.self_spec_min_context < 0 or self.self_spec_min_batch < 1:
            raise ValueError(f"self_spec_min_context must be >= 0 and self_spec_min_batch >= 1, got "
                             f"{self.self_spec_min_context}, {self.self_spec_min_batch}")
        SelfSpec(self.self_spec_window, self.self_spec_sinks)  # a ValueError names a bad window
        if self.draft_weights not in ("model", "fp8"):
            raise ValueError(f"draft_weights must be 'model' or 'fp8', got {self.draft_weights!r}")
        if self.draft_weights != "model" and not self.graphs:
            raise ValueError(f"draft_weights={self.draft_weights!r} is an option of the graph path, "
                             "which graphs=False turns off")
