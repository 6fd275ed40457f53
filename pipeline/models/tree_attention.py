"""Tree attention for a forward call that feeds the nodes of a token tree (SpecInfer; Sequoia).

A call's tree region is a run of cache entries starting at `base`: region node i lies at cache index base + i and
has its parent at region index parents[i] < i, or -1 for the token just before the region (the last token of the
prefix). Its RoPE position is base + depth(i) (depth 0 under the prefix), so a node's keys are those it would have
at the end of the accepted path; a query sees the whole prefix (cache indices < base) and, in the region, only
itself and its ancestors. Siblings share a position but not a cache entry: after acceptance the runner moves the
accepted path's entries to consecutive indices (`compact`), where their keys are already right.

A call may feed the region in parts (a draft model drafts a tree level by level): `first` names the region node
the call's first token is; the region's earlier nodes were written by earlier calls.

The static-shape graph path (`pipeline.models.graphs`) takes a whole region per call (`first` = 0) in a compact form
its kernels read: per fed node an ancestor bit set (bit j: region node j is the node itself or an ancestor) and its
depth, computed on the device by pointer jumping (`tree_bits`: log2(T) rounds of gathers, no host sync, capturable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeMask:
    """The tree structure of a forward call's region (module docstring)."""

    parents: torch.Tensor  # [B, R] int64: parent region index of each node (< its own), -1: the prefix's last token
    first: int = 0  # the call feeds region nodes first .. first + T - 1 (R = first + T)


def tree_depths(parents: torch.Tensor) -> torch.Tensor:  # [B, R] int64 -> [B, R] int64, 0 under the prefix
    return tree_ancestors(parents).sum(-1) - 1  # a node's ancestors in the region, itself included


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:  # [B, R] int64 -> [B, R, R] bool, [b, i, j]: j is i or
    """an ancestor of i. Pointer jumping: after round r a node holds its ancestors closer than 2**r and points at the
    2**r-th one: log2(R) rounds of a few gathers, whatever the tree (no per-node loop, no host read)."""
    B, R = parents.shape
    anc = torch.eye(R, dtype=torch.bool, device=parents.device).repeat(B, 1, 1)
    up = parents.clone()  # the 2**r-th ancestor, -1 past the prefix
    for _ in range(max(R - 1, 0).bit_length()):  # 2**rounds > the deepest node's depth
        has = up >= 0
        at = up.clamp_min(0)
        anc = anc | (anc.gather(1, at[..., None].expand(B, R, R)) & has[..., None])
        up = torch.where(has, up.gather(1, at), up)
    return anc


TREE_BITS_MAX = 63  # the most region nodes `tree_bits` encodes (bits of an int64)


def tree_bits(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [B, T] int64 -> bits, depth [B, T]
    """Each node's ancestor bit set (bit j set: region node j is the node or one of its ancestors) and its depth
    (0 under the prefix), by pointer jumping: after round r a node holds its ancestors closer than 2**r and points
    at the 2**r-th one. Static shapes and no host read: the graph path runs it inside its captured forward."""
    B, T = parents.shape
    assert T <= TREE_BITS_MAX, f"a tree region of {T} nodes; the bit sets hold at most {TREE_BITS_MAX}"
    node = torch.arange(T, device=parents.device)
    bits = (torch.ones_like(parents) << node[None, :]).contiguous()  # [B, T] the node itself
    up = parents.clone()  # the 2**r-th ancestor, -1 past the prefix
    depth = (parents >= 0).to(torch.int64)  # steps from the node to `up` (or to the prefix)
    for _ in range(max(T - 1, 0).bit_length()):  # 2**rounds > the deepest node's depth
        has = up >= 0
        at = up.clamp_min(0)
        bits = torch.where(has, bits | bits.gather(1, at), bits)
        depth = torch.where(has, depth + depth.gather(1, at), depth)
        up = torch.where(has, up.gather(1, at), up)
    return bits, depth


def tree_rope_and_mask(
    tree: TreeMask,
    positions: torch.Tensor,  # [B] int64 cache index of the call's first fed token
    T: int,  # tokens fed
    kv_len: int,  # keys read: cache indices 0 .. kv_len - 1
    windows: set[int | None],  # the model's attention windows (None: no window)
) -> tuple[torch.Tensor, dict[int | None, torch.Tensor]]:
    """-> RoPE positions [B, T] of the fed tokens, and per window the attention mask [B, 1, T, S] (True = attend)."""
    parents = tree.parents.to(positions.device)
    B, R = parents.shape
    assert R == tree.first + T, f"tree region of {R} nodes, but the call feeds {T} from node {tree.first}"
    depth = tree_depths(parents)  # [B, R]
    anc = tree_ancestors(parents)[:, tree.first:]  # [B, T, R]
    base = positions - tree.first  # [B] cache index of region node 0
    rope = base[:, None] + depth[:, tree.first:]  # [B, T]
    key_idx = torch.arange(kv_len, device=positions.device)  # [S]
    rel = key_idx[None, :] - base[:, None]  # [B, S] region index of each key
    in_region = (rel >= 0) & (rel < R)  # [B, S]
    relc = rel.clamp(0, R - 1)
    seen = anc.gather(2, relc[:, None, :].expand(B, T, kv_len)) & in_region[:, None, :]  # [B, T, S]
    visible = (rel < 0)[:, None, :] | seen  # the prefix, then the node's own path
    key_pos = torch.where(in_region, base[:, None] + depth.gather(1, relc), key_idx[None, :])  # [B, S]
    masks = {}
    for window in windows:
        m = visible if window is None else visible & (key_pos[:, None, :] > rope[:, :, None] - window)
        masks[window] = m[:, None]
    return rope, masks


def compact_indices(
    start: torch.Tensor,  # [B] int64 cache index of region node 0 (and of the path's first entry after the move)
    path: torch.Tensor,  # [B, M] int64 region index of the accepted node at depth j, -1 past the path's end
) -> tuple[torch.Tensor, torch.Tensor]:  # src, dst [B, M] cache indices; entries past the path copy onto themselves
    """Where `compact` moves each accepted node's cache entry: region node path[j] -> start + j."""
    M = path.shape[1]
    dst = start[:, None] + torch.arange(M, device=start.device)[None, :]
    src = torch.where(path >= 0, start[:, None] + path, dst)
    return src, dst
