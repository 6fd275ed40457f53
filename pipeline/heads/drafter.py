"""`HeadDrafter`: a Medusa or EAGLE-3 head behind the `Drafter` interface, drafting from the target's features.

The target computes the features in its own passes (`forward_features`): the engine's prefill over the prompt
and every verify pass. After each, the engine hands the drafter (`observe`) the features of the positions that
are now committed: at the prefill, positions 0..L-2 of an L-token prompt; after a verify pass fed at position P
that accepted n drafts, positions P..P+n (the pending token and the accepted drafts), each paired with the token
that follows it (the next prompt token, the accepted drafts, the recovered or bonus token).

- Medusa drafts from the feature of the last committed position: head i gives the token i+1 places past the
  pending one, all heads at once (a row drafts at most as many tokens as there are heads).
- EAGLE-3 first reads every pair it has not read into its own KV cache (one batched call), which gives the first
  draft, then drafts on from its own pre-norm output and the token it drafted, one position a call. A row that
  gathers `FEED_AT` unread pairs (a prompt) reads all but the last at once; the last one starts the next draft.

Both ship the sparse distribution their tokens were sampled from (`pipeline.drafters.sparse_draft`, with the
DRAFT random stream), so verification stays exact at any temperature.

The drafting itself (`medusa_draft`, `eagle3_chain`) is shared with `pipeline.device_loop`, which steps a batch with
a head as device work: `pending_pairs` hands it the pairs each row has not read.

With `draft_trees` a head drafts token trees of a static shape (`pipeline.tree`) instead of chains, on the step path:
`eagle3_tree` (level by level, under a tree mask in the head's cache) and `medusa_tree` (depth d from head d, in one
pass). The engine then observes the states of the accepted path, as after a chain.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from pipeline.config import EAGLE3_PREFIX, MEDUSA_PREFIX, TreeConfig
from pipeline.drafters import ProposeRow, sparse_draft
from pipeline.heads.eagle3 import Eagle3Head, load_eagle3
from pipeline.heads.medusa import MedusaHeads, load_medusa
from pipeline.models.store import resolve
from pipeline.models.tree_attention import TreeMask
from pipeline.rejection import DraftBlock
from pipeline.rng import Stream, uniform
from pipeline.sampling import SamplingTensors, sample_from_probs
from pipeline.transfer import to_device
from pipeline.tree import TreeShape, draw_children, tree_shape

FEED_AT = 16  # pairs observed at once (a prompt) go into the EAGLE-3 cache at once, not in a draft step


@dataclass
class _Row:
    slot: int
    fed: int = 0  # EAGLE-3: pairs (positions 0..fed-1) in the head's cache
    features: list[torch.Tensor] = field(default_factory=list)  # [n, F] each: observed, not yet read
    tokens: list[int] = field(default_factory=list)  # the token after each of those positions
    lost: bool = False  # a gap in the observed positions: this request drafts nothing more

    @property
    def pending(self) -> int:
        return len(self.tokens)


class HeadDrafter:
    """Drafts with a feature head; `feature_layers` names the target states it reads (`forward_features`)."""

    def __init__(self, head: MedusaHeads | Eagle3Head, feature_layers: tuple[int, ...], name: str) -> None:
        self.head, self.feature_layers, self.name = head, feature_layers, name
        self.eagle = isinstance(head, Eagle3Head)
        self.device = next(head.parameters()).device
        self._rows: dict[str, _Row] = {}
        self._free: list[int] = []
        self._out_ids = torch.arange(head.cfg.draft_vocab_size, device=self.device) + head.d2t if self.eagle else None
        # EAGLE-3 drafts on static buffers, one CUDA graph per shape (`_StaticChain` and its tree forms), on a GPU;
        # eagerly elsewhere (True on the CPU runs the static path uncaptured, for tests)
        self.static = self.eagle and self.device.type == "cuda"
        self._chains: dict[tuple, _StaticChain] = {}  # a static draft's buffers (and graph) per shape
        self._plans: dict[int, TreePlan] = {}  # a static tree's index tensors per depth drafted
        self._graph_pool = None
        self.tree: TreeShape | None = None  # `draft_trees`: token trees of this shape instead of chains
        self.dynamic: TreeConfig | None = None  # `draft_trees` with a dynamic config: greedy batches' trees

    def draft_trees(self, config: TreeConfig) -> None:
        """Draft token trees of `config`'s shape from now on (`eagle3_tree`, `medusa_tree`; the module docstring of
        `pipeline.tree` says how a tree is drafted and verified). The request's K caps the tree's depth, and so
        does Medusa's number of heads. With `config.dynamic` an EAGLE-3 head drafts greedy batches' trees by its
        own confidence (`eagle3_dynamic_tree`)."""
        if config.dynamic and not self.eagle:
            raise ValueError(f"a dynamic token tree is drafted by an EAGLE-3 head; {self.name} is not one")
        self.tree = tree_shape(config)
        self.dynamic = config if config.dynamic else None
        self._plans.clear()
        self.name = f"{self.name} (tree {'x'.join(map(str, config.branching))}, {self.tree.num_nodes} nodes)"

    @classmethod
    def from_spec(cls, spec: str, target) -> "HeadDrafter":
        """From a drafter word `medusa:DIR` or `eagle3:DIR` and the target runner it reads (a fast-path model)."""
        model = getattr(target, "runner", target).model if hasattr(target, "forward_features") else None
        if model is None:
            raise ValueError(f"drafter {spec!r} needs a fast-path target (its runner returns hidden states); "
                             f"{target.info.name} runs on the generic runner")
        dtype = model.tok_embeddings.weight.dtype
        name = spec.split(":", 1)[1]
        folder = Path(name) if Path(name).exists() else resolve(name)  # a folder, or a shipped head's name
        if not (folder / "config.json").exists():
            raise ValueError(f"drafter {spec!r}: no config.json in {folder}")
        if spec.startswith(MEDUSA_PREFIX):
            head = load_medusa(folder, model.output.weight, model.output.weight.device, dtype)
            return cls(head, head.feature_layers, f"medusa:{folder.name}")
        assert spec.startswith(EAGLE3_PREFIX), spec
        embed = model.tok_embeddings.weight
        head = load_eagle3(folder, embed, embed.device, dtype)
        layers = head.cfg.layers_for(model.args.n_layers)
        if max(layers) > model.args.n_layers or head.cfg.feature_size != model.args.dim:
            raise ValueError(f"drafter {spec!r} reads layers {layers} of width {head.cfg.feature_size}; "
                             f"{target.info.name} has {model.args.n_layers} layers of width {model.args.dim}")
        return cls(head, layers, f"eagle3:{folder.name}")

    # -- the engine's calls ----------------------------------------------------------------------------------
    def allocate(self, num_slots: int, max_len: int) -> None:
        """EAGLE-3's KV cache: one slot per request the engine holds, as long as the target's cache."""
        if self.eagle and (self.head.num_slots < num_slots or self.head.max_len < max_len):
            self.head.allocate(num_slots, max_len)
            self._chains.clear()  # their graphs point at the old cache
            self._free = [s for s in range(num_slots - 1, -1, -1) if s not in {r.slot for r in self._rows.values()}]

    def admit(self, request_id: str, context: Sequence[int]) -> None:
        if request_id in self._rows:
            return
        if self.eagle and not self._free:
            raise RuntimeError(f"{self.name}: no free head cache slot (allocate one per request the engine holds)")
        self._rows[request_id] = _Row(self._free.pop() if self.eagle else -1)

    def release(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None and self.eagle:
            self._free.append(row.slot)

    def observe(self, request_id: str, start: int, features: torch.Tensor, next_tokens: Sequence[int]) -> None:
        """The target's features [n, F] of positions start..start+n-1, now committed, and the token that follows
        each. Positions before `start` that were observed earlier are dropped (the request was rewound)."""
        row = self._rows.get(request_id)
        if row is None or row.lost:
            return
        n = min(len(next_tokens), features.shape[0])
        if n == 0:
            return
        have = row.fed + row.pending
        if start > have:  # a gap: the head could never read those positions
            row.lost = True
            return
        if start < row.fed:
            row.fed, row.features, row.tokens = start, [], []
        elif start < have:
            keep = start - row.fed
            flat = torch.cat(row.features)[:keep]
            row.features, row.tokens = [flat] if keep else [], row.tokens[:keep]
        row.features.append(features[:n])
        row.tokens.extend(int(t) for t in next_tokens[:n])
        if not self.eagle:
            row.features, row.tokens = row.features[-1:], row.tokens[-1:]
            row.fed = start + n - 1
        elif row.pending >= FEED_AT:
            self._read_head(row, keep=1)  # the last pair stays: the next draft starts from its logits

    def propose(self, rows: Sequence[ProposeRow], k: int, sampling: SamplingTensors, steps: torch.Tensor,
                draft_top_k: int) -> DraftBlock:
        B = len(rows)
        dev = self.device
        states = [self._rows.get(r.request_id) for r in rows]
        active = [b for b, s in enumerate(states) if s is not None and not s.lost and s.pending and rows[b].num_draft]
        width = min(draft_top_k, self.head.lm_head.out_features if self.eagle else self.head_vocab)
        if self.tree is not None:
            return self._propose_tree(rows, states, active, sampling, steps, width)
        tokens = torch.zeros(B, k, dtype=torch.int64, device=dev)
        top_ids = torch.zeros(B, k, width, dtype=torch.int64, device=dev)
        top_probs = torch.zeros(B, k, width, dtype=torch.float32, device=dev)
        num = [0] * B
        if active:
            depth = k if self.eagle else min(k, self.head.num_heads)
            sub = sampling.select(active)
            u = _draft_uniforms(sub, steps, active, k, dev)  # [A, K]
            draw = self._eagle_chain if self.eagle else self._medusa
            out_tok, out_ids, out_probs = draw([states[b] for b in active], depth, sub, u, draft_top_k)
            if len(active) == B:
                tokens[:, :depth], top_ids[:, :depth], top_probs[:, :depth] = out_tok, out_ids, out_probs
            else:
                a = to_device(active, dev)
                tokens[a, :depth], top_ids[a, :depth], top_probs[a, :depth] = out_tok, out_ids, out_probs
            for b in active:
                num[b] = min(rows[b].num_draft, depth)
        return DraftBlock(tokens, to_device(num, dev), top_ids, top_probs)

    def _propose_tree(self, rows: Sequence[ProposeRow], states: list[_Row | None], active: list[int],
                      sampling: SamplingTensors, steps: torch.Tensor, width: int) -> DraftBlock:
        """Each active row's tree of `self.tree`'s shape, cut to its budget's depth (and Medusa's heads)."""
        shape, dev = self.tree, self.device
        B, N = len(rows), shape.num_nodes
        most = shape.depth if self.eagle else min(shape.depth, self.head.num_heads)
        caps = [min(rows[b].num_draft, most) if b in active else 0 for b in range(B)]
        tokens = torch.zeros(B, N, dtype=torch.int64, device=dev)
        top_ids = torch.zeros(B, N, width, dtype=torch.int64, device=dev)
        top_probs = torch.zeros(B, N, width, dtype=torch.float32, device=dev)
        if active:
            depth = max(caps)
            n = shape.nodes_within(depth)
            sub = sampling.select(active)
            u = _draft_uniforms(sub, steps, active, N, dev)  # [A, N]
            rows_ = [states[b] for b in active]
            if self.eagle and self.dynamic is not None and sub.all_greedy:
                return _scatter_rows(B, active, self._dynamic_tree(rows_, depth, [caps[b] for b in active], sub, u),
                                     width)
            if self.eagle:
                out = self._static_tree(rows_, depth, sub, u, width)
            else:
                feats = torch.stack([s.features[-1][-1] for s in rows_]).to(dev)  # [A, C]
                out = medusa_tree(self.head, feats, shape, depth, sub, u, width)
            a = to_device(active, dev)
            tokens[a, :n], top_ids[a, :n], top_probs[a, :n] = out
        parents = to_device(shape.parents, dev).expand(B, N).contiguous()
        num = to_device([shape.nodes_within(c) for c in caps], dev)
        return DraftBlock(tokens, num, top_ids, top_probs, parents)

    def _tree_start(self, states: list[_Row]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' unread pairs read eagerly -> the first level's logits [A, V'] and r [A, C], the pending positions
        (where the tree region starts) and the head's slots [A] (host tensors)."""
        logits, r = self._read(states)
        return (logits, r, torch.tensor([s.fed for s in states], dtype=torch.int64),
                torch.tensor([s.slot for s in states], dtype=torch.int64))

    def _dynamic_tree(self, states: list[_Row], depth: int, caps: list[int], sampling: SamplingTensors,
                      u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' unread pairs read, then `eagle3_dynamic_tree` of `self.dynamic` cut to `depth` levels: where the
        head drafts statically, both on static buffers over a fixed span, one CUDA graph per shape (`_StaticTree`);
        eagerly otherwise."""
        branching = self.dynamic.branching[:depth]
        width = len(self.dynamic.branching) + 1  # the pairs a step observes: the pending token and the accepted path
        region = sum(branching[:-1])  # pairs the head's tree calls feed from the pending position on
        span = head_span_for(max(s.fed for s in states) + width + region, self.head.max_len)
        if not (self.static and span is not None):
            logits, r, pending, slots = self._tree_start(states)
            return eagle3_dynamic_tree(self.head, logits, r, pending, slots, branching, self.dynamic.max_nodes,
                                       torch.tensor(caps), self._out_ids)
        for s in states:
            if s.pending > width:  # (after a prefill) the older pairs first, eagerly
                self._read_head(s, keep=width)
        key = ("tree", len(states), width, depth, span)
        tree = self._chains.get(key)
        if tree is None:
            tree = self._chains[key] = _StaticTree(self, len(states), width, branching, sampling, span,
                                                   states[0].features[0].dtype)
        return tree.run(states, sampling, u, caps)

    def _static_tree(self, states: list[_Row], depth: int, sampling: SamplingTensors, u: torch.Tensor,
                     top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' unread pairs read, then `eagle3_tree` of `self.tree` cut to `depth` levels: where the head drafts
        statically, both on static buffers over a fixed span, one CUDA graph per shape (`_StaticFixedTree`); eagerly
        otherwise."""
        shape = self.tree
        plan = self._plans.get(depth)
        if plan is None:
            plan = self._plans[depth] = tree_plan(shape, depth, self.device)
        width = shape.depth + 1  # the pairs a step observes: the pending token and the accepted path
        region = shape.nodes_within(depth - 1)  # pairs the head's level calls feed from the pending position on
        span = head_span_for(max(s.fed for s in states) + width + region, self.head.max_len)
        if not (self.static and span is not None):
            logits, r, pending, slots = self._tree_start(states)
            return eagle3_tree(self.head, logits, r, pending, slots, shape, depth, sampling, u, top_k, self._out_ids,
                               plan)
        for s in states:
            if s.pending > width:  # (after a prefill) the older pairs first, eagerly
                self._read_head(s, keep=width)
        key = ("static tree", len(states), width, depth, top_k, sampling.all_greedy, sampling.any_greedy,
               sampling.needs_truncation, span)
        tree = self._chains.get(key)
        if tree is None:
            tree = self._chains[key] = _StaticFixedTree(self, len(states), width, plan, top_k, sampling, span,
                                                        states[0].features[0].dtype)
        return tree.run(states, sampling, u)

    def _eagle_chain_static(self, states: list[_Row], depth: int, sampling: SamplingTensors, u: torch.Tensor,
                            top_k: int, width: int, span: int):
        key = (len(states), width, depth, top_k, sampling.all_greedy, sampling.any_greedy, sampling.needs_truncation,
               span)
        chain = self._chains.get(key)
        if chain is None:
            dtype = states[0].features[0].dtype
            chain = self._chains[key] = _StaticChain(self, len(states), width, depth, top_k, sampling, span, dtype)
        return chain.run(states, sampling, u)

    def _pool(self):
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool

    @property
    def head_vocab(self) -> int:
        return self.head.shared.shape[0] if self.head.lm_heads is None else self.head.lm_heads[0].out_features

    @property
    def depth(self) -> int | None:
        """Most tokens a pass drafts (Medusa: its number of heads); None: any K (EAGLE-3 drafts on)."""
        return None if self.eagle else self.head.num_heads

    @property
    def feature_width(self) -> int:
        """Width of the target features the head reads per position (`forward_features` of `feature_layers`)."""
        if self.eagle:
            return self.head.fc.in_features
        return self.head.shared.shape[1] if self.head.lm_heads is None else self.head.lm_heads[0].in_features

    @torch.inference_mode()
    def pending_pairs(self, request_ids: Sequence[str], width: int, dtype: torch.dtype) -> PendingPairs:
        """Each row's observed pairs that the head has not read, as fixed-width tensors for a device loop's first
        catch-up (`pipeline.device_loop`): an EAGLE-3 row with more than `width` reads the older ones into its cache
        first. The rows are the device loop's from then on (their pairs here are not read again)."""
        B, dev = len(request_ids), self.device
        out = PendingPairs(torch.zeros(B, width, dtype=torch.int64), torch.zeros(B, width, self.feature_width,
                                                                               dtype=dtype),
                           torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64),
                           torch.zeros(B, dtype=torch.int64))
        for b, request_id in enumerate(request_ids):
            row = self._rows[request_id]
            assert not row.lost, f"{request_id}: the head missed positions of this request"
            if self.eagle and row.pending > width:
                self._read_head(row, keep=width)
            n = row.pending
            if n:
                out.tokens[b, :n] = torch.tensor(row.tokens, dtype=torch.int64)
                out.features[b, :n] = torch.cat(row.features)[-n:].to("cpu", dtype)  # Medusa: the last one
            out.start[b], out.count[b], out.slots[b] = row.fed, n, max(row.slot, 0)
            row.features, row.tokens = [], []
        return PendingPairs(*(t.to(dev) for t in (out.tokens, out.features, out.start, out.count, out.slots)))

    # -- drafting ------------------------------------------------------------------------------------------------
    def _medusa(self, states: list[_Row], depth: int, sampling: SamplingTensors, u: torch.Tensor, top_k: int):
        feats = torch.stack([s.features[-1][-1] for s in states]).to(self.device)  # [A, C]
        return medusa_draft(self.head, feats, depth, sampling, u, top_k)

    def _read_head(self, row: _Row, keep: int) -> None:
        """Read all but the last `keep` of one row's unread pairs into the EAGLE-3 cache."""
        n = row.pending - keep
        if n <= 0:
            return
        flat = torch.cat(row.features)
        self.head.step(torch.tensor([row.tokens[:n]], dtype=torch.int64), flat[None, :n],
                       torch.tensor([row.fed]), torch.tensor([row.slot]), fused=True)
        row.fed += n
        row.features, row.tokens = [flat[n:]], row.tokens[n:]

    def _read(self, states: list[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each row's unread pairs into the head's cache -> (logits [A, V'], r [A, C]) at each row's last pair."""
        head = self.head
        n = [s.pending for s in states]
        N = max(n)
        if len(states) > 1 and max(s.fed for s in states) + N > head.max_len:  # padding would run past the cache
            parts = [self._read([s]) for s in states]
            return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        F_ = states[0].features[0].shape[-1]
        feats = torch.zeros(len(states), N, F_, device=self.device, dtype=states[0].features[0].dtype)
        toks = torch.zeros(len(states), N, dtype=torch.int64)
        for b, s in enumerate(states):
            feats[b, : n[b]] = torch.cat(s.features).to(self.device)
            toks[b, : n[b]] = torch.tensor(s.tokens, dtype=torch.int64)
        starts = torch.tensor([s.fed for s in states], dtype=torch.int64)
        slots = torch.tensor([s.slot for s in states], dtype=torch.int64)
        logits, r = head.step(toks, feats, starts, slots, fused=True)  # [A, N, V'], [A, N, C]
        last = torch.tensor(n, device=logits.device) - 1
        rows = torch.arange(len(states), device=logits.device)
        for s in states:
            s.fed += s.pending
            s.features, s.tokens = [], []
        return logits[rows, last], r[rows, last]

    def _eagle_chain(self, states: list[_Row], depth: int, sampling: SamplingTensors, u: torch.Tensor, top_k: int):
        width = depth + 1  # the pairs a step observes: the pending token and up to K accepted drafts
        span = head_span_for(max(s.fed for s in states) + width + depth, self.head.max_len)
        if self.static and span is not None:
            for s in states:
                if s.pending > width:  # (after a prefill) the older pairs first, eagerly
                    self._read_head(s, keep=width)
            return self._eagle_chain_static(states, depth, sampling, u, top_k, width, span)
        logits, r = self._read(states)
        slots = torch.tensor([s.slot for s in states], dtype=torch.int64)
        nxt = torch.tensor([s.fed for s in states], dtype=torch.int64)  # the pending token's position
        return eagle3_chain(self.head, logits, r, nxt, slots, depth, sampling, u, top_k, self._out_ids)


def head_span_for(reach: int, max_len: int) -> int | None:
    """The cache positions a static EAGLE-3 step attends over when its queries reach position `reach` - 1: a power
    of two from 256 (a few graphs serve every context), at most the cache's length; None: past the cache."""
    if reach > max_len:
        return None
    return min(max(256, 1 << (reach - 1).bit_length()), max_len)


class _StaticChain:
    """One shape of `HeadDrafter`'s static EAGLE-3 draft: the rows' unread pairs, padded to `width` columns, read into
    the head's cache, then `eagle3_chain` over a fixed `span`, on static buffers: captured as one CUDA graph on a GPU
    (on the CPU run as is). Padded columns write cache positions past a row's pairs, which the chain's own steps and
    the next read overwrite before any query sees them (as `pipeline.device_loop` does)."""

    def __init__(self, drafter: "HeadDrafter", A: int, width: int, depth: int, top_k: int, sampling: SamplingTensors,
                 span: int, feat_dtype: torch.dtype, uniforms: int | None = None) -> None:
        """uniforms: DRAFT uniforms a row uses (default: `depth`, one per chain position)."""
        dev, head = drafter.device, drafter.head
        self.drafter, self.depth, self.top_k, self.span = drafter, depth, top_k, span
        z = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        self.tok, self.feat = z(A, width), z(A, width, head.fc.in_features, dtype=feat_dtype)
        self.start, self.last, self.slots, self.pos = z(A), z(A), z(A), z(A)
        self.u = z(A, depth if uniforms is None else uniforms, dtype=torch.float64)
        self.sampling = SamplingTensors(z(A, dtype=torch.float32), z(A), z(A, dtype=torch.float32), z(A),
                                        sampling.all_greedy, sampling.any_greedy, sampling.needs_truncation)
        self.width = width
        self.rows = torch.arange(A, device=dev)
        self.graph = None
        self.out = None

    def run(self, states: list[_Row], sampling: SamplingTensors, u: torch.Tensor):
        h = torch.zeros(5, len(states), self.width, dtype=torch.int64)  # tok, start, last, slots, pos: one copy
        for b, s in enumerate(states):
            n = s.pending
            h[0, b, :n] = torch.tensor(s.tokens, dtype=torch.int64)
            h[1:, b, 0] = torch.tensor([s.fed, n - 1, s.slot, s.fed + n])
            self.feat[b, :n].copy_(torch.cat(s.features)[-n:])
            s.fed += n
            s.features, s.tokens = [], []
        dev = to_device(h, self.tok.device)
        self.tok.copy_(dev[0])
        for dst, i in ((self.start, 1), (self.last, 2), (self.slots, 3), (self.pos, 4)):
            dst.copy_(dev[i, :, 0])
        st = self.sampling
        for dst, src in ((st.temperature, sampling.temperature), (st.top_k, sampling.top_k),
                         (st.top_p, sampling.top_p), (st.seeds, sampling.seeds)):
            dst.copy_(src)
        self.u.copy_(u[:, :self.u.shape[1]])
        if self.out is None:
            self.out = self._capture()
        elif self.graph is not None:
            self.graph.replay()
        else:
            self.out = self._body()
        return tuple(t.clone() for t in self.out)

    def _read_pairs(self) -> tuple[torch.Tensor, torch.Tensor]:  # logits [A, V'], r [A, C] at each row's last pair
        logits, r = self.drafter.head.step(self.tok, self.feat, self.start, self.slots, fused=True, span=self.span)
        return logits[self.rows, self.last], r[self.rows, self.last]

    def _body(self):
        hd = self.drafter
        logits, r = self._read_pairs()
        return eagle3_chain(hd.head, logits, r, self.pos, self.slots, self.depth, self.sampling, self.u, self.top_k,
                            hd._out_ids, self.span)

    def _capture(self):
        self.graph, out = _capture_static(self._body, self.tok.device, self.drafter)
        return out


def _capture_static(body: Callable[[], Any], dev: torch.device, drafter: "HeadDrafter") -> tuple[Any, Any]:
    """(CUDA graph of body(), its outputs) after running it once, on a GPU; (None, body()) elsewhere. The warm-up
    runs on a side stream (as torch.cuda.graphs recommends) and writes the same cache entries the replay writes
    again."""
    if dev.type != "cuda":
        return None, body()
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=drafter._pool()):
        out = body()
    graph.replay()
    return graph, out


class _StaticTree(_StaticChain):
    """One shape of `HeadDrafter`'s EAGLE-2 dynamic tree: `_StaticChain`'s read of the rows' unread pairs, then
    `eagle3_dynamic_tree` over the fixed span (greedy rows; the depth caps a buffer too), captured as one CUDA graph
    on a GPU (on the CPU run as is)."""

    def __init__(self, drafter: "HeadDrafter", A: int, width: int, branching: tuple[int, ...],
                 sampling: SamplingTensors, span: int, feat_dtype: torch.dtype) -> None:
        super().__init__(drafter, A, width, len(branching), 1, sampling, span, feat_dtype)
        self.branching = branching
        self.caps = torch.zeros(A, dtype=torch.int64, device=drafter.device)

    def run(self, states: list[_Row], sampling: SamplingTensors, u: torch.Tensor,
            caps: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.caps.copy_(to_device(caps, self.caps.device))
        return super().run(states, sampling, u)

    def _body(self):
        hd = self.drafter
        logits, r = self._read_pairs()
        return eagle3_dynamic_tree(hd.head, logits, r, self.pos, self.slots, self.branching, hd.dynamic.max_nodes,
                                   self.caps, hd._out_ids, self.span)


class _StaticFixedTree(_StaticChain):
    """One shape of `HeadDrafter`'s static token tree: `_StaticChain`'s read of the rows' unread pairs, then
    `eagle3_tree` of the plan's shape and depth over the fixed span (greedy and sampled rows), captured as one CUDA
    graph on a GPU (on the CPU run as is)."""

    def __init__(self, drafter: "HeadDrafter", A: int, width: int, plan: "TreePlan", top_k: int,
                 sampling: SamplingTensors, span: int, feat_dtype: torch.dtype) -> None:
        super().__init__(drafter, A, width, plan.depth, top_k, sampling, span, feat_dtype,
                         uniforms=plan.shape.num_nodes)
        self.plan = plan

    def _body(self):
        hd = self.drafter
        logits, r = self._read_pairs()
        return eagle3_tree(hd.head, logits, r, self.pos, self.slots, self.plan.shape, self.depth, self.sampling,
                           self.u, self.top_k, hd._out_ids, self.plan, self.span)


@dataclass(frozen=True)
class TreePlan:
    """A static tree's index tensors for `eagle3_tree`, made once per (shape, depth) on the head's device (no host
    copies while drafting, so the draft can be captured)."""

    shape: TreeShape
    depth: int  # levels drafted
    parents: torch.Tensor  # [n] int64 parent of each node within `depth` levels (-1: the pending token)
    own: tuple[torch.Tensor, ...]  # per level but the last: each node's parent's index within the level above


def tree_plan(shape: TreeShape, depth: int, dev: torch.device) -> TreePlan:
    own, above = [], [-1]
    for level in range(depth - 1):
        nodes = range(shape.nodes_within(level), shape.nodes_within(level + 1))
        own.append(to_device([above.index(shape.parents[i]) for i in nodes], dev))
        above = list(nodes)
    return TreePlan(shape, depth, to_device(shape.parents[:shape.nodes_within(depth)], dev), tuple(own))


@dataclass
class PendingPairs:
    """Rows' observed (feature, next token) pairs that the head has not read, padded to a fixed width."""

    tokens: torch.Tensor  # [B, W] int64: the token after each position
    features: torch.Tensor  # [B, W, F] the target's states at each position
    start: torch.Tensor  # [B] int64: position of column 0
    count: torch.Tensor  # [B] int64: valid columns (0: none, the row cannot draft yet)
    slots: torch.Tensor  # [B] int64: the rows' EAGLE-3 cache slots (0 for Medusa, which has no cache)


# -- the drafting functions, shared by `HeadDrafter` (step by step) and `pipeline.device_loop` (captured) ------------
def sample_draft(
    logits: torch.Tensor,  # [A, V'] float32
    sampling: SamplingTensors,  # per row
    u: torch.Tensor,  # [A] float64 DRAFT uniforms of this draft position
    top_k: int,
    out_ids: torch.Tensor | None,  # [V'] int64 target id of each logit (EAGLE-3's reduced vocabulary); None: itself
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # token [A], ids [A, k'], probs [A, k']
    ids, probs = sparse_draft(logits, sampling, top_k, out_ids)
    token = ids.gather(-1, sample_from_probs(probs, u)[:, None]).squeeze(-1)
    return token, ids, probs


def medusa_draft(
    heads: MedusaHeads,
    features: torch.Tensor,  # [A, C] the target's final normed state at each row's last committed position
    depth: int,  # tokens to draft (<= heads.num_heads)
    sampling: SamplingTensors,
    u: torch.Tensor,  # [A, >= depth] DRAFT uniforms
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # tokens [A, depth], ids [A, depth, k'], probs [A, depth, k']
    """Every head's draft at once: head j gives the token j+1 places past the pending one."""
    hidden = heads.hidden(features.to(next(heads.parameters()).dtype))  # [A, K, C]
    cols = [sample_draft(heads.logits(hidden[:, j], j), sampling, u[:, j], top_k, None) for j in range(depth)]
    return tuple(torch.stack(c, dim=1) for c in zip(*cols))


def eagle3_chain(
    head: Eagle3Head,
    logits: torch.Tensor,  # [A, V'] at each row's last read pair: the first draft's distribution
    r: torch.Tensor,  # [A, C] the head's pre-norm output there
    pending_pos: torch.Tensor,  # [A] int64 position of the pending token (the head's next pair goes there)
    slots: torch.Tensor,  # [A] int64 the rows' head cache slots
    depth: int,  # tokens to draft
    sampling: SamplingTensors,
    u: torch.Tensor,  # [A, >= depth] DRAFT uniforms
    top_k: int,
    out_ids: torch.Tensor,  # [V'] target id of each draft-vocabulary row
    span: int | None = None,  # `Eagle3Head.step`'s: None reads the positions back (a host sync); the cache length not
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # tokens [A, depth], ids [A, depth, k'], probs [A, depth, k']
    """Draft `depth` tokens autoregressively: each from the head's logits, the next pair being (its own output r,
    the token it drafted) at the next position."""
    cols = []
    for j in range(depth):
        cols.append(sample_draft(logits, sampling, u[:, j], top_k, out_ids))
        if j + 1 < depth:
            lg, rr = head.step(cols[-1][0][:, None], r[:, None], pending_pos + j, slots, fused=False, span=span)
            logits, r = lg[:, 0], rr[:, 0]
    return tuple(torch.stack(c, dim=1) for c in zip(*cols))


def eagle3_tree(
    head: Eagle3Head,
    logits: torch.Tensor,  # [A, V'] at each row's last read pair: the distribution of the pending token's children
    r: torch.Tensor,  # [A, C] the head's pre-norm output there
    pending_pos: torch.Tensor,  # [A] int64 position of the pending token: the tree region starts there
    slots: torch.Tensor,  # [A] int64 the rows' head cache slots
    shape: TreeShape,
    depth: int,  # levels to draft (<= shape.depth)
    sampling: SamplingTensors,
    u: torch.Tensor,  # [A, >= shape.num_nodes] DRAFT uniforms: node n draws with u[:, n]
    top_k: int,
    out_ids: torch.Tensor,  # [V'] target id of each draft-vocabulary row
    plan: TreePlan,  # `tree_plan(shape, depth)`
    span: int | None = None,  # `Eagle3Head.step`'s (the cache length: static shapes, capturable; `_StaticFixedTree`)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # tokens [A, n], ids [A, n, k], probs [A, n, k]; n nodes
    """Draft a tree level by level (`pipeline.tree.draw_children` draws each level's tokens): the pending token's
    children from `logits`, then one head call per level over that level's nodes, each node the pair (its parent's
    pre-norm output, its token). The calls write the head's cache as a tree region from the pending token's position
    (node i at index pending_pos + i, rotated by its depth, attending to the committed pairs and its ancestors): a
    node's logits are those of its root-to-node path drafted as a chain. The next read writes the committed pairs
    over the region (an accepted path's pairs are the chain's), and no query sees a region entry past them, so the
    head's cache needs no compaction."""
    A, dev = logits.shape[0], logits.device
    n = shape.nodes_within(depth)
    tokens, top_ids, top_probs = _tree_outputs(A, n, top_k, dev)
    parents = plan.parents.expand(A, n)
    greedy = (sampling.temperature == 0).to(dev)[:, None]  # [A, 1]
    level_logits, level_r, level_nodes = logits[:, None], r[:, None], [-1]  # per node of the level above
    for level in range(depth):
        lo, hi = shape.nodes_within(level), shape.nodes_within(level + 1)
        draw_children(shape, level_logits, level_nodes, range(lo, hi), sampling, u, greedy, tokens, top_ids,
                      top_probs, out_ids)
        if level + 1 < depth:  # the next level needs this one's logits
            level_logits, level_r = head.step(tokens[:, lo:hi], level_r[:, plan.own[level]],
                                              pending_pos + lo, slots, fused=False, span=span,
                                              tree=TreeMask(parents[:, :hi], first=lo))
            level_nodes = list(range(lo, hi))
    return tokens, top_ids, top_probs


def eagle3_dynamic_tree(
    head: Eagle3Head,
    logits: torch.Tensor,  # [A, V'] at each row's last read pair: the distribution of the pending token's children
    r: torch.Tensor,  # [A, C] the head's pre-norm output there
    pending_pos: torch.Tensor,  # [A] int64 position of the pending token: the head's tree region starts there
    slots: torch.Tensor,  # [A] int64 the rows' head cache slots
    branching: tuple[int, ...],  # per depth: nodes kept to grow on, and children per grown node
    budget: int,  # nodes verified
    caps: torch.Tensor,  # [A] int64 per row: the deepest it may draft (its K)
    out_ids: torch.Tensor,  # [V'] target id of each draft-vocabulary row
    span: int | None = None,  # `Eagle3Head.step`'s (the cache length: static shapes, capturable; `_StaticTree`)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # tokens [A, budget], parents [A, budget], nodes [A]
    """EAGLE-2's dynamic tree for greedy rows (Li et al. 2024): a node's score is its path's log-probability under
    the head. The pending token's branching[0] likeliest children are drafted; at each depth d >= 1 the kept nodes
    of depth d - 1 (the branching[d - 1] best-scored, all of them at depth 0) go through the head in one call (a tree
    region in its cache, as in `eagle3_tree`) and each gets its branching[d] likeliest children, of which the
    branching[d] best-scored are kept. Of every node drafted, the `budget` best-scored of depth < the row's cap are
    verified, numbered by depth (a parent scores at least as well as its child, so they form a tree, parents
    first). Greedy verification walks the tree: each node ships as a point mass."""
    A, dev = logits.shape[0], logits.device
    lp, idx = logits.float().log_softmax(-1).topk(branching[0], dim=-1)  # [A, b0]
    scores, tokens, parents, depths = [lp], [out_ids[idx]], [torch.full_like(idx, -1)], [torch.zeros_like(idx[0])]
    keep = torch.arange(branching[0], device=dev).expand(A, -1)  # [A, w] candidate index of each kept node
    keep_r = r[:, None].expand(-1, branching[0], -1)  # [A, w, C] each kept node's parent output
    region_parent = torch.full((A, 0), -1, dtype=torch.int64, device=dev)  # parents within the head's region
    keep_region_parent = torch.full((A, branching[0]), -1, dtype=torch.int64, device=dev)
    seen = branching[0]  # candidates so far
    for d in range(1, len(branching)):
        lo = region_parent.shape[1]
        region_parent = torch.cat([region_parent, keep_region_parent], dim=1)
        toks = torch.cat(tokens, dim=1).gather(1, keep)  # [A, w]: target ids; the head embeds target ids
        lg, out_r = head.step(toks, keep_r, pending_pos + lo, slots, fused=False, span=span,
                              tree=TreeMask(region_parent, first=lo))  # [A, w, V'], [A, w, C]
        kept_scores = torch.cat(scores, dim=1).gather(1, keep)  # [A, w]
        clp, cidx = lg.float().log_softmax(-1).topk(branching[d], dim=-1)  # [A, w, b]
        child = (kept_scores[..., None] + clp).flatten(1)  # [A, w * b]
        scores.append(child)
        tokens.append(out_ids[cidx].flatten(1))
        parents.append(keep[..., None].expand(-1, -1, branching[d]).flatten(1))
        depths.append(torch.full_like(child[0], d, dtype=torch.int64))
        best = child.topk(min(branching[d], child.shape[1]), dim=-1).indices  # [A, w']
        keep = seen + best
        keep_r = out_r.gather(1, (best // branching[d])[..., None].expand(-1, -1, out_r.shape[-1]))
        keep_region_parent = lo + best // branching[d]  # the kept node's parent was fed at region index lo + i
        seen += child.shape[1]
    score = torch.cat(scores, dim=1)  # [A, M]
    depth = torch.cat(depths)  # [M] each candidate's depth
    allowed = depth[None, :] < caps.to(dev)[:, None]  # [A, M]
    # ties: the shallower first, so a parent never ranks below its child
    key = torch.where(allowed, score - 1e-4 * depth, float("-inf"))
    n = min(budget, score.shape[1])
    chosen = key.topk(n, dim=-1).indices  # [A, n]
    valid = allowed.gather(1, chosen)
    chosen = torch.where(valid, chosen, chosen + score.shape[1]).sort(dim=-1).values % score.shape[1]  # by depth
    order = torch.arange(n, device=dev).expand(A, -1)
    new_index = torch.full_like(score, -1, dtype=torch.int64).scatter_(1, chosen, order)
    par = torch.cat(parents, dim=1).gather(1, chosen)
    new_par = torch.where(par >= 0, new_index.gather(1, par.clamp_min(0)), -1)
    return torch.cat(tokens, dim=1).gather(1, chosen), new_par, valid.sum(-1)


def _draft_uniforms(sampling: SamplingTensors, steps: torch.Tensor, active: list[int], n: int,
                    dev: torch.device) -> torch.Tensor:  # [A, n] float64
    """The active rows' DRAFT uniforms of this step. A greedy row's draft distribution is a point mass, which any
    uniform draws: an all-greedy batch takes a constant instead of the hash (about 60 small kernels a step)."""
    if sampling.all_greedy:
        return torch.full((len(active), n), 0.5, dtype=torch.float64, device=dev)
    idx = to_device(active, steps.device)
    return uniform(sampling.seeds, steps[idx], Stream.DRAFT, n).to(dev)


def _tree_outputs(A: int, n: int, top_k: int, dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zeroed tokens [A, n], ids [A, n, k] and probs [A, n, k] for a tree drafter to fill level by level."""
    return (torch.zeros(A, n, dtype=torch.int64, device=dev), torch.zeros(A, n, top_k, dtype=torch.int64, device=dev),
            torch.zeros(A, n, top_k, dtype=torch.float32, device=dev))


def _scatter_rows(B: int, active: list[int], tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                  width: int) -> DraftBlock:
    """A `DraftBlock` of B rows from the active rows' greedy trees (tokens, parents, nodes): point masses."""
    tokens, parents, nodes = tree
    dev, N = tokens.device, tokens.shape[1]
    if len(active) == B:  # every row drafted: the trees are the block's rows
        out_tok, out_par, num = tokens, parents, nodes
    else:
        a = to_device(active, dev)
        out_tok = torch.zeros(B, N, dtype=torch.int64, device=dev)
        out_par = torch.arange(-1, N - 1, device=dev).expand(B, N).contiguous()  # inactive rows: a chain of no nodes
        num = torch.zeros(B, dtype=torch.int64, device=dev)
        out_tok[a], out_par[a], num[a] = tokens, parents, nodes
    top_ids = out_tok[..., None].expand(-1, -1, width).contiguous()
    top_probs = torch.zeros(B, N, width, device=dev)
    top_probs[..., 0] = 1.0
    return DraftBlock(out_tok, num, top_ids, top_probs, out_par)


def medusa_tree(
    heads: MedusaHeads,
    features: torch.Tensor,  # [A, C] the target's final normed state at each row's last committed position
    shape: TreeShape,
    depth: int,  # levels to draft (<= shape.depth, <= heads.num_heads)
    sampling: SamplingTensors,
    u: torch.Tensor,  # [A, >= shape.num_nodes] DRAFT uniforms: node n draws with u[:, n]
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # tokens [A, n], ids [A, n, k], probs [A, n, k]; n nodes
    """Medusa's tree in one pass of the heads: every node at depth d draws from head d's distribution, whatever its
    parent (greedy: the node of rank r is head d's r-th token, Medusa's Cartesian product; sampled: each parent's
    children drawn without replacement from head d, `pipeline.tree.draw_children`). A head's distribution does not
    depend on the tokens above it, so it is the distribution each node was drawn from, given its earlier siblings,
    as the multi-draft verification needs."""
    A, dev = features.shape[0], features.device
    n = shape.nodes_within(depth)
    tokens, top_ids, top_probs = _tree_outputs(A, n, top_k, dev)
    greedy = (sampling.temperature == 0).to(dev)[:, None]  # [A, 1]
    hidden = heads.hidden(features.to(next(heads.parameters()).dtype))  # [A, K, C]
    level_nodes = [-1]
    for level in range(depth):
        lo, hi = shape.nodes_within(level), shape.nodes_within(level + 1)
        logits = heads.logits(hidden[:, level], level)  # [A, V]: the same for every parent
        draw_children(shape, logits[:, None].expand(-1, len(level_nodes), -1), level_nodes, range(lo, hi), sampling,
                      u, greedy, tokens, top_ids, top_probs)
        level_nodes = list(range(lo, hi))
    return tokens, top_ids, top_probs


def head_info(folder: str | Path) -> dict:
    """The head checkpoint's config.json (for a CLI line)."""
    return json.loads((Path(folder) / "config.json").read_text())
