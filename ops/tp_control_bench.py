"""How long rank 0's message takes to reach the other ranks of a tensor-parallel group, per control channel
(`pipeline.models.tp_control`): the part of a driven step (`TensorParallelRunner`) that the SPMD step of
`ops.tp_bench` does not pay. CPU only: no GPU, no model.

    python -m ops.tp_control_bench --ranks 2,4 --kinds socket:0,socket:20,gloo

N processes (spawned, one gloo group) open each channel as a serving replica does (a GPU group's socket
channel polls for up to 20 ms before it blocks: `socket:20`). Rank 0 then sends a
decode step's message (header + one token, position and slot) every `--gap-ms`, the followers waiting in
`recv` as they are between steps, and stamps its send time (CLOCK_MONOTONIC, one clock for every process of
the host) into the payload. Each follower records receive - send. A step waits for its slowest follower, so the
table reports, per message, the latest follower's latency: median and p90, in microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.models.tp_control import open_control, parse_control  # noqa: E402


def _rank(rank: int, world: int, port: int, kinds: list[str], n: int, gap_s: float, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result: dict[str, list[int]] = {}
    for spec in kinds:
        kind, spin_ms = parse_control(spec)
        channel = open_control(rank, world, None, kind if rank == 0 else None, 30.0, spin_ms if rank == 0 else None)
        lat = []
        for i in range(n + 10):
            if rank == 0:
                time.sleep(gap_s)
                channel.send([1, 1, 1, 0, i, 0], [time.perf_counter_ns(), 512, 0])
            else:
                _header, payload = channel.recv()
                lat.append(time.perf_counter_ns() - int(payload[0]))
        result[spec if channel.kind == "socket" else channel.kind] = lat[10:]
        dist.barrier()
        channel.close()
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered[1:]))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import tempfile

    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--kinds", default="socket:0,socket:20,gloo",
                   help="channels, each with an optional :MS, the followers' poll window (socket:0 blocks at once)")
    p.add_argument("--messages", type=int, default=300)
    p.add_argument("--gap-ms", type=float, default=2.0, help="time between rank 0's messages (a step's length)")
    p.add_argument("--json", default=None, help="write the table's numbers here")
    args = p.parse_args(argv)
    kinds = args.kinds.split(",")
    rows = []
    print(f"host: {socket.gethostname()}, {os.cpu_count()} CPUs; {args.messages} messages, one every "
          f"{args.gap_ms} ms")
    print("| ranks | channel | median us | p90 us | max us |")
    print("|---|---|---|---|---|")
    for world in (int(r) for r in args.ranks.split(",")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            mp.spawn(_rank, args=(world, port, kinds, args.messages, args.gap_ms / 1e3, f.name), nprocs=world)
            per_follower = json.loads(Path(f.name).read_text())
        for kind in per_follower[0]:
            slowest = sorted(max(vals) / 1e3 for vals in zip(*(r[kind] for r in per_follower)))
            row = {"ranks": world, "channel": kind, "median_us": statistics.median(slowest),
                   "p90_us": slowest[int(0.9 * (len(slowest) - 1))], "max_us": slowest[-1]}
            rows.append(row)
            print(f"| {world} | {kind} | {row['median_us']:.1f} | {row['p90_us']:.1f} | {row['max_us']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
