"""Counter-based randomness: every random number is a pure function of (seed, step, stream, index).

There is no generator state. A request's random numbers therefore do not depend on which other requests
share its batch, on the device, or on which process draws them: a request resumed on another coordinator
from (committed tokens, step, seed) continues with exactly the tokens the lost one would have produced.

The mixing function is the PCG hash (Jarzynski & Olano, "Hash Functions for GPU Rendering", JCGT 2020),
evaluated on 32-bit values held in int64 tensors so no product overflows. Uniforms carry 32 random bits.
"""

from __future__ import annotations

import enum

import torch

_MASK32 = 0xFFFFFFFF


class Stream(enum.IntEnum):
    """Independent streams of one (seed, step)."""

    DRAFT = 1  # the drafter's sampling at draft position j
    ACCEPT = 2  # the acceptance uniform u_i of draft position i
    TARGET = 3  # the recovered (i < num_draft) or bonus token at position i


def _pcg(x: torch.Tensor) -> torch.Tensor:
    """One round of the PCG hash on uint32 values stored in int64. [*] -> [*]"""
    state = (x * 747796405 + 2891336453) & _MASK32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & _MASK32
    return ((word >> 22) ^ word) & _MASK32


def request_key(seeds: torch.Tensor, steps: torch.Tensor, stream: Stream) -> torch.Tensor:
    """Hash (seed, step, stream) per row into a 32-bit key. seeds, steps: [B] int64 -> [B] int64."""
    h = _pcg(seeds & _MASK32)
    h = _pcg(h ^ ((seeds >> 32) & _MASK32))
    h = _pcg(h ^ (steps & _MASK32))
    return _pcg(h ^ int(stream))


def uniform(
    seeds: torch.Tensor,  # [B] int64
    steps: torch.Tensor,  # [B] int64
    stream: Stream,
    num: int,  # uniforms per row, indexed 0..num-1 (draft/accept/target position)
) -> torch.Tensor:  # [B, num] float64 in the open interval (0, 1)
    key = request_key(seeds, steps, stream)  # [B]
    index = torch.arange(num, device=seeds.device, dtype=torch.int64)  # [num]
    h = _pcg(_pcg(key[:, None] ^ index[None, :]))  # [B, num], two rounds: adjacent indices decorrelate
    return (h.to(torch.float64) + 0.5) / 4294967296.0
