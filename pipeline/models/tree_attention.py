"""Tree attention for a forward call that feeds the nodes of a token tree (SpecInfer; Sequoia).

A call's tree region is a run of cache entries starting at `base`: region node i lies at cache index base + i and
has its parent at region index parents[i] < i, or -1 for the token just before the region (the last token of the
prefix). Its RoPE position is base + depth(i) (depth 0 under the prefix), so a node's keys are those it would have
at the end of the accepted path; a query sees the whole prefix (cache indices < base) and, in the region, only
itself and its ancestors. Siblings share a position but not a cache entry: after acceptance the runner moves the
accepted path's entries to consecutive indices (`compact`), where their keys are already right.

A call may feed the region in parts (a draft model drafts a tree level by level): `first` names the region node
the call's first token is; the region's earlier nodes were written by earlier calls.
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
    B, R = parents.shape
    depth = torch.zeros(B, R, dtype=torch.int64, device=parents.device)
    for i in range(1, R):  # parents precede their children
        p = parents[:, i]
        depth[:, i] = torch.where(p >= 0, depth.gather(1, p.clamp_min(0)[:, None]).squeeze(1) + 1, 0)
    return depth


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:  # [B, R] int64 -> [B, R, R] bool, [b, i, j]: j is i or
    B, R = parents.shape                                      # an ancestor of i
    anc = torch.eye(R, dtype=torch.bool, device=parents.device).repeat(B, 1, 1)
    rows = torch.arange(B, device=parents.device)
    for i in range(1, R):
        p = parents[:, i]
        inherited = anc[rows, p.clamp_min(0)] & (p >= 0)[:, None]  # [B, R]
        anc[:, i] |= inherited
    return anc


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
