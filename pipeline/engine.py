"""The in-process speculative decoding engine: one target, optionally one drafter, a batch of requests.

    engine = SpeculativeEngine.from_pretrained()                 # demo target + default drafter
    result = engine.generate("Hello", SamplingParams(temperature=0.7, seed=1), SpecParams(4))
    result.token_ids, result.text, result.stats

Continuous batching over the step's pieces in `pipeline.step` (the Serve layer runs the same ones): each step
(one target pass for every active request) the drafter proposes up to K tokens per row, the target scores
[pending] + draft in one forward, `verify` + `accept` (pipeline.rejection) pick the emitted tokens, and each
request commits them (stopping at EOS, stop strings, max_tokens). The one host sync per step is reading the
accepted counts and tokens back.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from pipeline.adaptive import AdaptiveK
from pipeline.config import (
    DEFAULT_DRAFT,
    EAGLE3_PREFIX,
    HYBRID_PREFIX,
    PROMPT_LOOKUP,
    EngineConfig,
    SamplingParams,
    SpecParams,
    TreeConfig,
)
from pipeline.cross_tokenizer import CrossTokenizerDrafter
from pipeline.device_loop import DeviceLoop, device_resident
from pipeline.drafters import Drafter, HybridDrafter, ModelDrafter, ProposeRow, build_drafter
from pipeline.models.base import CausalLM, warmup
from pipeline.models.graphs import GraphConfig, graphs_on_cuda
from pipeline.models.loader import load_model
from pipeline.models.store import DEMO_HEAD, DEMO_TARGET, resolve
from pipeline.sampling import SamplingTensors
from pipeline.self_spec import LongContextDrafter, SelfSpecDrafter, auto_self_spec
from pipeline.sequence import RequestState
from pipeline.step import (
    CACHE_SLACK,
    Verdict,
    catch_up,
    commit,
    draft_budgets,
    empty_block,
    new_k_policy,
    propose,
    retire,
    verify_and_accept,
)
from pipeline.synthetic import SyntheticDrafter
from pipeline.transfer import to_device
from pipeline.tree import TreeDrafter, supports_tree

log = logging.getLogger(__name__)


def default_draft(target: str | None) -> str:
    """The default drafter for a target, in process and in Serve alike. The demo target gets its shipped EAGLE-3 head
    behind prompt lookup ("lookup+eagle3:smollm2-135m-eagle3": 1.56x target-only on the 2-core CPU, one stream,
    against 1.40x for "lookup+smollm2-135m-distill"; in Serve both run in the target worker). Any other target gets
    prompt lookup: no shipped drafter shares its tokenizer."""
    if target not in (None, DEMO_TARGET):
        return PROMPT_LOOKUP
    return HYBRID_PREFIX + EAGLE3_PREFIX + DEMO_HEAD


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    seed: int
    stats: dict[str, Any]


@dataclass
class StreamEvent:
    request_id: str
    token_ids: list[int]  # committed in this step
    text: str  # text safe to show now (stop strings held back)
    finished: bool
    result: GenerationResult | None = None  # on the last event


@dataclass
class EngineTimings:
    """Where the engine's time went (host wall clock, seconds)."""

    draft_s: float = 0.0
    target_s: float = 0.0
    steps: int = 0
    steps_by_k: dict[int, int] = field(default_factory=dict)  # target passes by draft tokens fed (K)
    extra: dict[str, float] = field(default_factory=dict)


class SpeculativeEngine:
    def __init__(
        self,
        target: CausalLM,
        tokenizer: Any | None = None,
        drafter: Drafter | None = None,
        config: EngineConfig | None = None,
        k_policy: AdaptiveK | None = None,  # K per step for greedy rows from measured costs (None: spec's K)
    ) -> None:
        self.config = config or EngineConfig()
        model_drafter = _model_drafter(drafter)
        draft_weights = self.config.draft_weights
        if draft_weights != "model" and model_drafter is None:
            raise ValueError(f"draft_weights={draft_weights!r} applies to a draft model, and this drafter has none")
        if self.config.graphs:  # static-shape CUDA-graph path for models on CUDA
            target = _graphs_on_cuda(target)
            if model_drafter is not None:
                model_drafter.model = _graphs_on_cuda(model_drafter.model, draft_weights)
        if _head_drafter(drafter) is None:  # long prompts draft with the target itself (the heads keep theirs)
            drafter = auto_self_spec(drafter, target, self.config)
        bind = getattr(drafter, "bind_target", None)  # self-speculation drafts through the runner that verifies
        if bind is not None:
            bind(target)
        if self.config.tree is not None:
            drafter = _tree_drafter(drafter, target, self.config.tree)
            if _drafts_trees(drafter):
                k_policy = None  # a static shape: K caps the tree's depth, no per-step choice
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        self.k_policy = k_policy
        cache_len = self.config.max_seq_len + CACHE_SLACK
        if target.num_slots < self.config.max_batch_size or target.max_len < cache_len:
            target.allocate(self.config.max_batch_size, cache_len)
        if model_drafter is not None:
            m = model_drafter.model
            if m.num_slots < self.config.max_batch_size or m.max_len < cache_len:
                m.allocate(self.config.max_batch_size, cache_len)
        self.head = _head_drafter(drafter)  # a feature head: the target's passes return the states it reads
        self._feature_layers: tuple[int, ...] = ()
        if self.head is not None:
            if not hasattr(target, "forward_features"):
                raise ValueError(f"drafter {self.head.name} reads the target's hidden states: the target "
                                 f"{target.info.name} must run on the fast path")
            self.head.allocate(self.config.max_batch_size, cache_len)
            self._feature_layers = self.head.feature_layers
        self.timings = EngineTimings()
        self._free_slots = list(range(self.config.max_batch_size - 1, -1, -1))
        self._sampling: tuple[tuple[str, ...], SamplingTensors] | None = None  # the last step's rows and tensors
        self._loops: dict[tuple, DeviceLoop] = {}  # `EngineConfig.device_loop`: one per batch shape

    def warmup(self, max_draft_tokens: int) -> dict[str, float]:
        """Capture now the CUDA graphs of every step shape this engine can run (batch sizes up to max_batch_size;
        the target's verify calls up to K = max_draft_tokens; every length a draft model's catch-up call may
        have, since a row that went without drafts for a while feeds all it missed), so that no step pays a
        capture later: a server does this before taking traffic. No-op for runners without graphs (CPU).
        -> captures, seconds."""
        if max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0, got {max_draft_tokens}")
        t0 = time.perf_counter()
        drafter = _model_drafter(self.drafter)
        captures = warmup(self.target, self.config.max_batch_size, max_draft_tokens + 1)
        if self._feature_layers and max_draft_tokens > 0:  # a head's step path: passes that return its states
            captures += warmup(self.target, self.config.max_batch_size, max_draft_tokens + 1, self._feature_layers)
        if drafter is not None and max_draft_tokens > 0:
            captures += warmup(drafter.model, self.config.max_batch_size)  # every length
        nodes = _tree_nodes(self.drafter)
        if nodes and max_draft_tokens > 0:  # the tree's verify passes (a head's tree drafts capture on first use)
            captures += warmup(self.target, self.config.max_batch_size, nodes + 1, self._feature_layers, tree=True)
        return {"captures": captures, "seconds": time.perf_counter() - t0}

    # -- construction ----------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        target: str | None = None,
        draft: str | None = DEFAULT_DRAFT,
        config: EngineConfig | None = None,
        adaptive_k: bool = False,
    ) -> "SpeculativeEngine":
        """target: a model folder, a .gguf file, or None for the demo model. draft: a model path,
        "prompt-lookup", "suffix" (suffix decoding), "lookup+MODEL" (prompt lookup where it matches, the model
        elsewhere), "default" (`default_draft(target)`), or None for target-only decoding. adaptive_k: greedy
        requests draft 0..K tokens per step, whichever the measured step costs and acceptance say pays most
        (`pipeline.adaptive`)."""
        config = config or EngineConfig()
        model, tokenizer = load_model(str(resolve(target)), device=config.device, dtype=config.dtype)
        if draft == DEFAULT_DRAFT:
            draft = default_draft(target)
        drafter = build_drafter(draft, model.info, tokenizer, config.device, config.dtype, target=model)
        return cls(model, tokenizer, drafter, config, k_policy=new_k_policy() if adaptive_k else None)

    # -- public API ------------------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        spec: SpecParams | None = None,
        chat: bool = False,
    ) -> GenerationResult:
        return self.generate_batch([prompt], params, spec, chat)[0]

    def generate_batch(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        spec: SpecParams | None = None,
        chat: bool = False,
    ) -> list[GenerationResult]:
        results: dict[str, GenerationResult] = {}
        states = self._make_states(prompts, params, chat)
        for event in self._run(states, spec or SpecParams()):
            if event.result is not None:
                results[event.request_id] = event.result
        return [results[s.request_id] for s in states]

    def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        spec: SpecParams | None = None,
        chat: bool = False,
    ) -> Iterator[StreamEvent]:
        return self._run(self._make_states([prompt], params, chat), spec or SpecParams())

    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass token ids")
        if chat:
            messages = [{"role": "user", "content": prompt}]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return list(self.tokenizer(prompt)["input_ids"])

    # -- the loop ----------------------------------------------------------------------------------------
    def _make_states(self, prompts, params, chat: bool) -> list[RequestState]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        assert len(params) == len(prompts), f"{len(params)} sampling params for {len(prompts)} prompts"
        states = []
        for prompt, p in zip(prompts, params):
            ids = self.encode(prompt, chat)
            self._check_length(len(ids), p.max_tokens)
            state = RequestState(
                request_id=uuid.uuid4().hex,
                prompt_ids=ids,
                params=p.with_seed(),
                eos_token_ids=self.target.info.eos_token_ids,
            )
            if self.tokenizer is not None:
                state.attach_tokenizer(self.tokenizer)
            states.append(state)
        return states

    def _check_length(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len < 1:
            raise ValueError("prompt is empty")
        limit = self.config.max_seq_len
        if prompt_len + max_tokens > limit:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context length ({limit})"
            )

    def _run(self, states: list[RequestState], spec: SpecParams) -> Iterator[StreamEvent]:
        """Continuous batching: admit while slots are free, step all active requests, retire finished."""
        if self._device_loop_fits(states):
            yield from self._run_device_loop(states, spec)
            return
        waiting = list(states)
        active: list[tuple[RequestState, int]] = []  # (state, target slot)
        try:
            while waiting or active:
                while waiting and self._free_slots:
                    state = waiting.pop(0)
                    slot = self._free_slots.pop()
                    self._prefill(state, slot)
                    active.append((state, slot))
                events = self.step([s for s, _ in active], [slot for _, slot in active], spec)
                yield from events
                still = []
                for state, slot in active:
                    if state.finished:
                        self._retire(state, slot)
                    else:
                        still.append((state, slot))
                active = still
        finally:  # a consumer that stops iterating (client gone) frees everything
            for state, slot in active:
                state.abort()
                self._retire(state, slot)

    def _device_loop_fits(self, states: list[RequestState]) -> bool:
        """`EngineConfig.device_loop` applies (None: where the step can be captured): one draft model, one feature
        head or no drafter, a fixed K, every request admitted at once."""
        drafter = self.drafter
        head = _head_drafter(drafter) is drafter and drafter is not None  # a head alone (not behind prompt lookup)
        plain = drafter is None or head or type(drafter) in (ModelDrafter, SyntheticDrafter)
        if not plain or _drafts_trees(drafter):  # the loop drafts and verifies chains
            return False
        enabled = self.config.device_loop
        if enabled is None:  # a head runs on the target's device in plain torch ops, which capture with it
            enabled = device_resident(self.target) and (drafter is None or head or device_resident(drafter.model))
        return enabled and self.k_policy is None and 0 < len(states) <= len(self._free_slots)

    def _run_device_loop(self, states: list[RequestState], spec: SpecParams) -> Iterator[StreamEvent]:
        """The batch on `pipeline.device_loop.DeviceLoop`: step t+1 is launched before step t's tokens are read."""
        slots = [self._free_slots.pop() for _ in states]
        active = list(zip(states, slots))
        try:
            for state, slot in active:
                self._prefill(state, slot)
            loop = self._device_loop(states, slots, spec)
            loop.launch()
            while True:
                # Step t+1 goes out before step t is read, unless step t surely ends every row (max_tokens).
                if any(not s.finished and s.remaining > 1 for s in states):
                    loop.launch()
                t0 = time.perf_counter()
                num_accepted, emitted = loop.collect()
                self.timings.target_s += time.perf_counter() - t0  # waiting for the device
                self.timings.steps += 1
                done = []
                for b, state in enumerate(states):
                    if state.finished:
                        continue
                    committed, text = commit(state, Verdict(loop.depth, num_accepted[b], emitted[b]))
                    if state.finished:
                        done.append(b)
                    yield StreamEvent(state.request_id, committed, text, state.finished,
                                      self._result(state) if state.finished else None)
                if all(s.finished for s in states):
                    break
                if done:
                    loop.freeze(done)
                if not loop.in_flight:
                    loop.launch()
        finally:
            for state, slot in active:
                if not state.finished:
                    state.abort()
                self._retire(state, slot)

    def _device_loop(self, states: list[RequestState], slots: list[int], spec: SpecParams) -> DeviceLoop:
        """The loop of this batch's shape (kept: its captured graph serves every later batch of the shape), loaded
        with the batch."""
        device = self.target.device if hasattr(self.target, "device") else torch.device("cpu")
        sampling = SamplingTensors.from_params([s.params for s in states], device)
        drafter = _model_drafter(self.drafter)
        head = _head_drafter(self.drafter)
        k = spec.num_draft_tokens if drafter is not None or head is not None else 0
        overrides = d_slots = pairs = None
        if drafter is not None:
            d_slots = [drafter._slot(s.request_id, {s.request_id for s in states}) for s in states]
            if hasattr(drafter, "loop_overrides"):  # a synthetic-acceptance drafter: its proposals are the batch's
                overrides = drafter.loop_overrides(states, device)
        span = None
        if head is not None and k:  # the pairs the head has not read: the loop's first catch-up
            pairs = head.pending_pairs([s.request_id for s in states], k + 1, self.target.dtype)
            if head.eagle and device_resident(self.target):
                span = head_span(states, k)
        key = (len(states), k, spec.draft_top_k, sampling.all_greedy, sampling.any_greedy, sampling.needs_truncation,
               overrides is not None, span)
        loop = self._loops.get(key)
        if loop is None:
            loop = self._loops[key] = DeviceLoop(
                self.target, len(states), sampling, k, None if drafter is None else drafter.model, spec.draft_top_k,
                None if drafter is None else drafter._out_ids, overrides, head=head if k else None, head_span=span)
        loop.start([s.context for s in states], [s.step for s in states], [s.remaining for s in states], slots,
                   d_slots, sampling, overrides, pairs)
        return loop

    def _retire(self, state: RequestState, slot: int) -> None:
        self._free_slots.append(slot)
        if self.drafter is not None:
            retire(self.drafter, state)
        if self.head is not None:
            self.head.release(state.request_id)

    @torch.inference_mode()
    def _prefill(self, state: RequestState, slot: int) -> None:
        """Fill the target cache with all committed tokens but the last (which the first step feeds)."""
        ctx = state.context
        features = None
        if len(ctx) > 1:
            t0 = time.perf_counter()
            tokens = torch.tensor([ctx[:-1]], dtype=torch.int64)
            args = (tokens, torch.zeros(1, dtype=torch.int64), torch.tensor([slot]))
            if self._feature_layers:  # the head reads the prompt's states: positions 0..L-2
                features = self.target.forward_features(*args, self._feature_layers, len(ctx) - 2)[1][0]
            else:
                self.target.forward(*args, len(ctx) - 2)
            self.timings.target_s += time.perf_counter() - t0
        if self.drafter is not None:  # the drafter's own one-time work, out of the timed decode steps
            t0 = time.perf_counter()
            assign = getattr(self.drafter, "assign_slot", None)  # self-speculation reads the target's slot
            if assign is not None:
                assign(state.request_id, slot)
            self.drafter.admit(state.request_id, ctx)
            if self.head is not None:
                self.head.admit(state.request_id, ctx)
                if features is not None:
                    self.head.observe(state.request_id, 0, features, ctx[1:])
            self.timings.draft_s += time.perf_counter() - t0

    @torch.inference_mode()
    def step(self, states: list[RequestState], slots: list[int], spec: SpecParams) -> list[StreamEvent]:
        """One target pass for every request in `states` (all unfinished, prefilled), over `pipeline.step`."""
        B = len(states)
        device = self.target.device if hasattr(self.target, "device") else torch.device("cpu")
        # A request's sampling parameters never change: rebuild the tensors (four host-to-device copies) only when
        # the rows do, i.e. when a request joins or leaves.
        rows_key = tuple(s.request_id for s in states)
        if self._sampling is None or self._sampling[0] != rows_key:
            self._sampling = (rows_key, SamplingTensors.from_params([s.params for s in states], device))
        sampling = self._sampling[1]
        steps = to_device([s.step for s in states], device)
        t0 = time.perf_counter()
        captures = self._captures()
        policy = self.k_policy if self.drafter is not None else None
        wants, adapt = draft_budgets(states, spec.num_draft_tokens if self.drafter else 0, policy)
        catch_up_s = 0.0
        if max(wants) > 0:
            rows = [ProposeRow(s.request_id, s.context_view, w, s.params.greedy) for s, w in zip(states, wants)]
            t_prep = time.perf_counter()
            catch_up(self.drafter, rows)  # timed apart: the K policy's cost for K leaves it out
            catch_up_s = time.perf_counter() - t_prep
            draft = propose(self.drafter, rows, sampling, steps, spec.draft_top_k).to(device)
        else:
            draft = empty_block(B, device)
        t1 = time.perf_counter()
        pending = to_device([s.last_token for s in states], device)
        positions = torch.tensor([s.length - 1 for s in states], dtype=torch.int64)  # on the host: no device sync
        verdicts = verify_and_accept(self.target, pending, draft, positions, torch.tensor(slots, dtype=torch.int64),
                                     sampling, steps, self._feature_layers if self.drafter is not None else ())
        if self.head is not None and self.drafter is not None:  # the states of the newly committed positions
            for state, verdict in zip(states, verdicts):
                self.head.observe(state.request_id, state.length - 1, verdict.features, verdict.tokens)
        t2 = time.perf_counter()
        K = draft.k
        self.timings.draft_s += t1 - t0
        self.timings.target_s += t2 - t1
        self.timings.steps += 1
        self.timings.steps_by_k[K] = self.timings.steps_by_k.get(K, 0) + 1
        if adapt:
            # A step that captured a CUDA graph (a new batch/K/context bucket) is no measure of its cost.
            self.k_policy.observe(B, K, t2 - t0 - catch_up_s, [v.num_draft for v in verdicts],
                                  [v.num_accepted for v in verdicts], timed=self._captures() == captures)

        events = []
        for state, verdict in zip(states, verdicts):
            committed, text = commit(state, verdict)
            result = self._result(state) if state.finished else None
            events.append(StreamEvent(state.request_id, committed, text, state.finished, result))
        return events

    def _captures(self) -> int:
        """CUDA graphs captured so far by the target and a model drafter (0 for eager runners)."""
        drafter = _model_drafter(self.drafter)
        models = [self.target, drafter.model if drafter is not None else None]
        return sum(getattr(getattr(m, "stats", None), "captures", 0) for m in models)

    def _result(self, state: RequestState) -> GenerationResult:
        return GenerationResult(
            request_id=state.request_id,
            token_ids=list(state.output_ids),
            text=state.text,
            finish_reason=state.finish_reason or "abort",
            seed=int(state.params.seed),
            stats=state.stats.summary(),
        )


def head_span(states: Sequence[RequestState], k: int) -> int:
    """The cache positions a captured EAGLE-3 step attends over for this batch: past every position its queries
    can reach (a row's context and remaining tokens, a step run past its end, K+1 catch-up and K drafts), as a power
    of two from 256, so a few graphs serve every batch."""
    reach = max(len(s.context) + s.remaining for s in states) + 4 * k + 8
    return max(256, 1 << (reach - 1).bit_length())


def _head_drafter(drafter: Drafter | None):  # -> pipeline.heads.drafter.HeadDrafter | None
    """The feature head inside `drafter` (itself or a hybrid's model part), if any."""
    from pipeline.heads.drafter import HeadDrafter

    if isinstance(drafter, HybridDrafter):
        drafter = drafter.model
    return drafter if isinstance(drafter, HeadDrafter) else None


def _tree_drafter(drafter: Drafter | None, target: CausalLM, tree: TreeConfig) -> Drafter | None:
    """`drafter` drafting trees of `tree`'s shape: a `TreeDrafter` over a draft model, or a feature head set to draft
    trees (`HeadDrafter.draft_trees`). A target or draft model on a path without tree attention (the generic
    runner, tensor parallelism) keeps chains, logged; any other drafter is refused."""
    from pipeline.heads.drafter import HeadDrafter

    head = _head_drafter(drafter)
    if isinstance(drafter, HybridDrafter) and head is None:
        raise ValueError(f"a token tree drafts with a draft model or a feature head alone, or with a feature head "
                         f"behind prompt lookup: use {drafter.model.name!r} without {HYBRID_PREFIX!r}")
    if isinstance(head, HeadDrafter):  # alone, or behind prompt lookup (whose rows stay chains)
        if not supports_tree(target):
            log.warning("token trees: the target runs on %s, which has no tree attention; drafting chains instead",
                        type(target).__name__)
        else:
            head.draft_trees(tree)
        return drafter
    if not isinstance(drafter, ModelDrafter):
        raise ValueError(f"a token tree needs a draft model of the target's vocabulary or a feature head; drafter "
                         f"{getattr(drafter, 'name', None)!r} is neither")
    if tree.dynamic:
        raise ValueError(f"a dynamic token tree is drafted by an EAGLE-3 head; {drafter.name!r} is a draft model")
    for role, model in (("target", target), ("draft model", drafter.model)):
        if not supports_tree(model):
            log.warning("token trees: the %s runs on %s, which has no tree attention; drafting chains instead",
                        role, type(model).__name__)
            return drafter
    return TreeDrafter(drafter, tree)


def _drafts_trees(drafter: Drafter | None) -> bool:
    """Whether `drafter` drafts token trees (a `TreeDrafter`, or a feature head set to)."""
    return isinstance(drafter, TreeDrafter) or getattr(_head_drafter(drafter), "tree", None) is not None


def _tree_nodes(drafter: Drafter | None) -> int:
    """The most nodes a pass verifies when `drafter` drafts token trees (0: chains)."""
    if isinstance(drafter, TreeDrafter):
        return drafter.shape.num_nodes
    head = _head_drafter(drafter)
    if head is None or head.tree is None:
        return 0
    return head.dynamic.max_nodes if head.dynamic is not None else head.tree.num_nodes


def _model_drafter(drafter: Drafter | None) -> ModelDrafter | None:
    """The draft model's drafter inside `drafter` (itself, a hybrid's model part, a cross-tokenizer drafter's, a tree
    drafter's), if any."""
    if isinstance(drafter, TreeDrafter):
        drafter = drafter.drafter
    if isinstance(drafter, LongContextDrafter):
        drafter = drafter.base
    if isinstance(drafter, HybridDrafter):
        drafter = drafter.model
    if isinstance(drafter, CrossTokenizerDrafter):
        drafter = drafter.drafter
    # a self-speculation drafter's model is the target itself: nothing of its own to allocate or capture
    return drafter if isinstance(drafter, ModelDrafter) and not isinstance(drafter, SelfSpecDrafter) else None


def _graphs_on_cuda(model: CausalLM, weights: str = "model") -> CausalLM:
    """The static-shape graph runner for Llama-family models on a CUDA device; others unchanged. `weights`:
    `GraphConfig.weights` ('fp8' for a drafter's float8 copies; 'model': the model's own)."""
    if weights != "model" and torch.device(getattr(model, "device", "cpu")).type != "cuda":
        raise ValueError(f"draft_weights={weights!r} needs the draft model on a CUDA device "
                         "(it is a graph-path option)")
    return graphs_on_cuda(model, GraphConfig(weights=weights) if weights != "model" else None)
