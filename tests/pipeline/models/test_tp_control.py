"""The tensor-parallel control channels (`pipeline.models.tp_control`) between real processes: every message
arrives whole and in order over the Unix-socket and the gloo channel, with and without the followers' polling;
"auto" falls back to gloo when a rank is on another host, and "socket" then fails on every rank with the reason."""

from __future__ import annotations

import json
import os
import socket
import traceback
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.models.tp_control import INLINE, open_control, parse_control
from tests.support import ROOT

# (header, payload): a decode step, a verify step of two rows, a no-op, a prefill longer than gloo's inline ids
MESSAGES = [([1, 1, 1, 0, 0, 0], [7, 512, 3]),
            ([1, 2, 5, 4, 0, 0], list(range(10)) + [40, 41, 0, 1]),
            ([0, 0, 0, 0, 0, 0], []),
            ([1, 1, INLINE + 100, 0, 0, 0], [(i * 7919) % 128256 for i in range(INLINE + 100)] + [0, 2])]


def _rank(rank: int, world: int, port: int, specs: list[str], other_host: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        if other_host and rank == world - 1:  # this rank claims another host: no socket to rank 0
            from pipeline.models import tp_control

            tp_control.socket.gethostname = lambda: "another-host"
        got: dict[str, object] = {}
        for spec in specs:
            kind, spin = parse_control(spec)
            try:
                channel = open_control(rank, world, None, kind if rank == 0 else None, 10.0,
                                       spin if rank == 0 else None)
            except RuntimeError as err:
                got[spec] = f"RuntimeError: {err}"
                continue
            if rank == 0:
                for header, payload in MESSAGES:
                    channel.send(header, payload)
                got[spec] = channel.kind
            else:
                received = []
                for _ in MESSAGES:
                    header, payload = channel.recv()
                    received.append((header, [] if payload is None else payload.tolist()))
                got[spec] = {"kind": channel.kind, "messages": received,
                             "spin_s": getattr(channel, "spin_s", None)}
            dist.barrier()
            channel.close()
        Path(out, f"rank{rank}.json").write_text(json.dumps(got))
    except BaseException:  # noqa: BLE001 - the test reads it
        Path(out, f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, specs: list[str], other_host: bool, tmp_path: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(_rank, args=(world, port, specs, other_host, str(tmp_path)), nprocs=world,
                           start_method="spawn")
    except Exception:  # noqa: BLE001
        errors = sorted(tmp_path.glob("error*.txt"))
        raise AssertionError(errors[0].read_text() if errors else "a rank failed")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def test_every_message_arrives_whole_over_each_channel(tmp_path):
    specs = ["socket:0", "socket:5", "gloo", "auto"]
    ranks = run_ranks(3, specs, False, tmp_path)
    assert [ranks[0][s] for s in specs] == ["socket", "socket", "gloo", "socket"]  # one host: auto is the socket
    for follower in ranks[1:]:
        for spec in specs:
            assert follower[spec]["messages"] == [[h, p] for h, p in MESSAGES], spec
        assert follower["socket:0"]["spin_s"] == 0.0 and follower["socket:5"]["spin_s"] == 0.005  # rank 0 decides


def test_a_rank_on_another_host_gets_gloo_or_a_clear_error(tmp_path):
    ranks = run_ranks(3, ["auto", "socket"], True, tmp_path)
    assert ranks[0]["auto"] == "gloo" and all(f["auto"]["kind"] == "gloo" for f in ranks[1:])
    for r in ranks:  # every rank, not only the one that could not connect
        assert r["socket"].startswith("RuntimeError: the socket control channel could not be set up"), r
    assert "not on rank 0's host" in ranks[2]["socket"]
    assert ranks[2]["auto"]["messages"] == [[h, p] for h, p in MESSAGES]


def test_an_unknown_channel_is_refused():
    with pytest.raises(ValueError, match="control channel must be one of"):
        parse_control("shm")
    assert parse_control("socket:2.5") == ("socket", 2.5) and parse_control("gloo") == ("gloo", None)



def test_the_control_channel_benchmark_runs_and_prints_its_table(tmp_path):
    import subprocess
    import sys

    root = ROOT
    out = subprocess.run([sys.executable, "-m", "ops.tp_control_bench", "--ranks", "2", "--messages", "20",
                          "--gap-ms", "1", "--json", str(tmp_path / "c.json")],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "c.json").read_text())
    assert [r["channel"] for r in rows] == ["socket:0", "socket:20", "gloo"]
    assert all(0 < r["median_us"] <= r["p90_us"] <= r["max_us"] for r in rows)
    assert "| 2 | gloo |" in out.stdout
