"""How rank 0 of a tensor-parallel group tells the other ranks what to run: one message a call.

A message is a header of `HEADER` ints (op, B, T, logits_from, a, b) and a payload of ints (a forward's tokens,
positions and slots), sent from lists and received as an int64 tensor. Two channels carry it, chosen once,
collectively, when the group starts driving (`open_control`):

- "socket": one Unix-domain stream socket from rank 0 to each other rank (Linux abstract names: no file to
  clean up). A send is one `sendall` a follower. A follower polls its socket for up to `spin_ms` after each
  message (the next step's comes within a few ms while a replica serves), then blocks in `recv` (the GIL
  released). On the GPU hosts measured a message reached blocked followers in 92-123 us, polling ones in 32-67
  (2 and 4 ranks): waking a blocked process is most of it. Rank 0
  decides the window for every rank (`DEFAULT_SPIN_MS`; 0 on CPU groups, where a polling rank would take a core
  from the computing ones). Taken by "auto" when every rank runs on rank 0's host, which the Ray layout
  guarantees (STRICT_PACK bundles on one node).
- "gloo": a broadcast over the gloo control group: a fixed message of the header and up to `INLINE` payload
  ids, and a second broadcast for longer payloads (prefills). Any layout; what "auto" falls back to.

Both detect the same failures: a follower blocked longer than the control timeout raises (`TimeoutError`; rank
0's heartbeats keep an idle group alive), a closed peer raises at once (`ConnectionError`, or gloo's error),
and the caller (`TensorParallelRunner`, `follow`) turns either into `TensorParallelError`.
Measured on a 4x H100 host (docs/benchmarks.md): a message reaches the last of 3 followers in 67 us
polling, 123 us blocking, 528 us over gloo (`python -m ops.tp_control_bench`); a driven 8B TP=4 step takes 2.67 ms
polling against 3.24 over gloo (`python -m ops.tp_bench --control socket:20,gloo`).
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
import uuid
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

HEADER = 6  # [op, B, T, logits_from, a, b]
INLINE = 1024  # gloo: payload ids that ride in the header's message (one broadcast a decode/verify step)
CONTROL_KINDS = ("auto", "socket", "gloo")
# The leader's choice when none is passed ("auto": the socket channel where every rank is on rank 0's host).
DEFAULT_KIND = "auto"
# How long a follower polls for the next message before it blocks (socket channel, GPU groups), in ms: a serving
# replica's next step comes within a few ms, and a polling follower gets it in 32-67 us instead of 92-123.
DEFAULT_SPIN_MS = 20.0
_FRAME = struct.Struct(f"<{HEADER + 1}q")  # socket frame: payload length, then the header


def parse_control(spec: str) -> tuple[str, Optional[float]]:
    """"socket:5" -> ("socket", 5.0): a channel kind and, optionally, the followers' poll window in ms (the
    benchmarks' way to name a variant)."""
    kind, _, spin = spec.partition(":")
    if kind not in CONTROL_KINDS:
        raise ValueError(f"control channel must be one of {CONTROL_KINDS}, got {kind!r}")
    return kind, float(spin) if spin else None


class GlooChannel:
    kind = "gloo"

    def __init__(self, group: Any) -> None:
        self.group = group

    def send(self, header: list[int], payload: Sequence[int] = ()) -> None:
        n = len(payload)
        msg = torch.zeros(1 + HEADER + INLINE, dtype=torch.int64)
        msg[: 1 + HEADER + min(n, INLINE)] = torch.tensor([n, *header, *payload[:INLINE]], dtype=torch.int64)
        dist.broadcast(msg, src=0, group=self.group)
        if n > INLINE:
            dist.broadcast(torch.tensor(payload, dtype=torch.int64), src=0, group=self.group)

    def recv(self) -> tuple[list[int], Optional[torch.Tensor]]:
        msg = torch.zeros(1 + HEADER + INLINE, dtype=torch.int64)
        dist.broadcast(msg, src=0, group=self.group)
        n, *header = msg[: 1 + HEADER].tolist()
        if n == 0:
            return header, None
        if n <= INLINE:
            return header, msg[1 + HEADER: 1 + HEADER + n].clone()
        payload = torch.empty(n, dtype=torch.int64)
        dist.broadcast(payload, src=0, group=self.group)
        return header, payload

    def close(self) -> None:
        pass


class SocketChannel:
    """Rank 0: `conns` (one a follower, in rank order); a follower: `conns` = [its connection to rank 0]."""

    kind = "socket"

    def __init__(self, conns: list[socket.socket], spin_ms: float = 0.0) -> None:
        self.conns = conns
        self.spin_s = spin_ms / 1e3
        self._poll = select.poll() if self.spin_s else None  # a follower's, while it polls
        if self._poll is not None:
            self._poll.register(conns[0], select.POLLIN)

    def send(self, header: list[int], payload: Sequence[int] = ()) -> None:
        frame = struct.pack(f"<{1 + HEADER + len(payload)}q", len(payload), *header, *payload)  # no torch op
        for c in self.conns:
            c.sendall(frame, socket.MSG_NOSIGNAL)  # a dead follower: EPIPE now, not a signal

    def recv(self) -> tuple[list[int], Optional[torch.Tensor]]:
        if self.spin_s:  # poll (a syscall of about 1 us, the GIL released) while a message is likely soon
            deadline = time.perf_counter() + self.spin_s
            while not self._poll.poll(0) and time.perf_counter() < deadline:
                pass
        n, *header = _FRAME.unpack(_read_exact(self.conns[0], _FRAME.size))
        return header, (torch.frombuffer(_read_exact(self.conns[0], 8 * n), dtype=torch.int64) if n else None)

    def close(self) -> None:
        for c in self.conns:
            c.close()


def open_control(rank: int, world_size: int, group: Any, kind: Optional[str] = None, timeout_s: float = 30.0,
                 spin_ms: Optional[float] = None) -> GlooChannel | SocketChannel:
    """Every rank of `group` (the gloo control group) calls this at once; rank 0's `kind` and `spin_ms` decide
    (the others pass None; defaults `DEFAULT_KIND`, `DEFAULT_SPIN_MS`). "socket" where it cannot be set up
    (another host, no abstract sockets) raises on every rank; "auto" falls back to gloo. `timeout_s`: how long a
    follower's `recv` may wait (the control timeout)."""
    kind = (kind or DEFAULT_KIND) if rank == 0 else None
    spin_ms = (DEFAULT_SPIN_MS if spin_ms is None else spin_ms) if rank == 0 else None
    if rank == 0 and kind not in CONTROL_KINDS:
        raise ValueError(f"control channel must be one of {CONTROL_KINDS}, got {kind!r}")
    listener, name = None, ""
    if rank == 0 and kind != "gloo" and world_size > 1:
        try:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            name = f"\0specserve-tp-{os.getpid()}-{uuid.uuid4().hex}"
            listener.bind(name)
            listener.listen(world_size)
        except (OSError, AttributeError):  # no AF_UNIX or no abstract names (not Linux)
            listener, name = None, ""
    told = [kind, name, socket.gethostname(), spin_ms]
    dist.broadcast_object_list(told, src=0, group=group)
    kind, name, host, spin_ms = told
    if kind == "gloo" or world_size == 1:
        return GlooChannel(group)
    conn, why = None, ""
    if rank != 0:
        try:
            if not name or host != socket.gethostname():
                raise OSError(f"rank {rank} is not on rank 0's host ({host})" if name else "rank 0 has no socket")
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(timeout_s)
            conn.connect(name)
            conn.sendall(struct.pack("<q", rank))
        except OSError as err:
            why = str(err)
            if conn is not None:
                conn.close()
            conn = None
    ok = torch.tensor([int(listener is not None if rank == 0 else conn is not None)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if not ok.item():
        if listener is not None:
            listener.close()
        if conn is not None:
            conn.close()
        if kind == "socket":
            raise RuntimeError("the socket control channel could not be set up on every rank"
                               + (f": {why}" if why else ""))
        return GlooChannel(group)
    if rank != 0:
        return SocketChannel([conn], spin_ms)
    by_rank: dict[int, socket.socket] = {}
    listener.settimeout(timeout_s)
    try:
        for _ in range(world_size - 1):  # every follower connected before the all_reduce: they wait in the backlog
            c, _addr = listener.accept()
            c.settimeout(timeout_s)  # also bounds a send to a follower that stopped reading (a dead one: EPIPE)
            (r,) = struct.unpack("<q", _read_exact(c, 8))
            c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
            by_rank[r] = c
    finally:
        listener.close()
    return SocketChannel([by_rank[r] for r in sorted(by_rank)])


def _read_exact(conn: socket.socket, size: int) -> bytearray:
    """`size` bytes from `conn`; socket.timeout (TimeoutError) past its timeout, ConnectionError if the peer left."""
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        k = conn.recv_into(view[got:], size - got)
        if k == 0:
            raise ConnectionError("the other end closed the control connection")
        got += k
    return buf
