"""Helpers for the tensor-parallel tests: rank processes (spawned, gloo over TCP on localhost), the fixed
calls every scenario makes, and a tiny model with every awkward feature (uneven KV groups, biases on every
projection, a vocabulary and an MLP width not divisible by the ranks)."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from deployments.ray_env import apply_ray_defaults

apply_ray_defaults()

SLOTS, MAX_LEN = 4, 96
GRAPH_BUCKETS = dict(batch_buckets=(1, 2, 4), token_buckets=(1, 2, 4), kv_block=16)


def free_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def make_odd_llama(path: Path, seed: int = 5) -> Path:
    """6 heads / 3 KV heads (2 + 1 groups over 2 ranks), q/k/v/o and MLP biases, vocab 127, MLP width 130."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=127, hidden_size=48, intermediate_size=130, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3, max_position_embeddings=512, attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if name.endswith("norm.weight") else p.normal_(
                0.0, 0.1 if p.dim() == 1 else 48**-0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


# -- the calls every scenario makes (the same on the reference, TP=1, and on every rank) -------------------

def prompts(vocab: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(vocab)
    return torch.randint(0, vocab, (9,), generator=g).tolist(), torch.randint(0, vocab, (14,), generator=g).tolist()


def script(runner: Any, vocab: int, greedy_tokens: int = 12) -> dict[str, torch.Tensor]:
    """Prefill two slots (full logits), a ragged verify-shaped call (2 rows, 3 tokens, different positions),
    then greedy decoding of one request. Returns what rank 0 / the reference records."""
    a, b = prompts(vocab)
    out: dict[str, torch.Tensor] = {}
    i64 = dict(dtype=torch.int64)
    out["prefill_a"] = runner.forward(torch.tensor([a]), torch.tensor([0]), torch.tensor([1]))
    out["prefill_b"] = runner.forward(torch.tensor([b]), torch.tensor([0]), torch.tensor([2]))
    rows = torch.tensor([[3, 4, 5], [7, 8, 9]], **i64)
    out["verify"] = runner.forward(rows, torch.tensor([len(b), len(a)]), torch.tensor([2, 1]))
    tokens = list(a)
    runner.forward(torch.tensor([a[:-1]]), torch.tensor([0]), torch.tensor([0]), len(a) - 2)
    for _ in range(greedy_tokens):
        logits = runner.forward(torch.tensor([[tokens[-1]]]), torch.tensor([len(tokens) - 1]), torch.tensor([0]))
        tokens.append(int(logits[0, -1].argmax()))
    out["greedy"] = torch.tensor(tokens[len(a):])
    return out


LONG = 1100  # a prefill past the ids that ride inline in gloo's control message (1024)


def long_prompt() -> torch.Tensor:
    return torch.randint(0, 128, (1, LONG), generator=torch.Generator().manual_seed(11))


# -- rank processes ---------------------------------------------------------------------------------------

def spawn(target: Callable, world_size: int, *args: Any) -> list[mp.Process]:
    ctx = mp.get_context("spawn")
    init = free_init_method()
    procs = [ctx.Process(target=_guarded, args=(target, rank, world_size, init, *args), daemon=True)
             for rank in range(world_size)]
    for p in procs:
        p.start()
    return procs


def _guarded(target: Callable, rank: int, *args: Any) -> None:
    torch.set_num_threads(1)
    out_dir = Path(args[-1])
    try:
        target(rank, *args)
    except BaseException:  # noqa: BLE001 - the test reads it
        (out_dir / f"error{rank}.txt").write_text(traceback.format_exc())
        raise


def save_atomic(obj, path: Path) -> None:
    """torch.save to a temporary name, then rename: a parent waiting for `path` (`wait_file`) never reads a file
    that is still being written."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def wait_file(path: Path, timeout_s: float, procs: list[mp.Process]) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        errors = list(path.parent.glob("error*.txt"))
        if errors:
            raise AssertionError(errors[0].read_text())
        if time.monotonic() > deadline or not any(p.is_alive() for p in procs):
            raise AssertionError(f"{path.name} never appeared (exit codes {[p.exitcode for p in procs]})")
        time.sleep(0.05)


def compare_ranks(rank: int, world_size: int, init: str, models: dict[str, str], out_dir: str) -> None:
    """The main scenario: SPMD scripts over every model, then driven mode (rank 0 + follow()) with an idle
    gap longer than the control timeout, then the static graph path, then rank 1 gets killed by the test."""
    from pipeline.models.tensor_parallel import (
        TensorParallelError,
        TensorParallelRunner,
        follow,
        init_tensor_parallel,
        load_tensor_parallel_model,
        tensor_parallel_graphs,
    )

    out = Path(out_dir)
    tp = init_tensor_parallel(rank, world_size, init, "cpu", collective_timeout_s=20, control_timeout_s=2.0)
    results: dict[str, Any] = {}
    for name, path in models.items():  # SPMD: every rank runs the same script
        stats: dict = {}
        runner = load_tensor_parallel_model(path, tp, stats=stats)
        runner.allocate(SLOTS, MAX_LEN)
        got = script(runner, runner.info.vocab_size, greedy_tokens=8 if name == "demo" else 12)
        results[name] = {**got, "elements_read": stats["elements"],
                         "local_elements": sum(p.numel() for p in runner.model.parameters()),
                         "cache_bytes": runner.cache_bytes(), "info": runner.info}
    save_atomic({n: (r["elements_read"], r["local_elements"], r["cache_bytes"]) for n, r in results.items()},
               out / f"read{rank}.pt")
    for name in ("llama_mha_tied", "odd"):  # the GPU default: every rank holds the whole embedding table
        if name in models:
            runner = load_tensor_parallel_model(models[name], tp, replicate_embedding=True)
            runner.allocate(SLOTS, MAX_LEN)
            results[f"{name}+replicated_embedding"] = {
                **script(runner, runner.info.vocab_size), "embedding_rows": runner.model.tok_embeddings.weight.shape[0],
                "output_rows": runner.model.output.weight.shape[0]}
    first = next(iter(models))

    def driven(make: Callable[[], Any], key: str, control: str) -> None:
        inner = make()
        if rank == 0:
            leader = TensorParallelRunner(inner, tp, heartbeat_s=0.4, control=control)
            results[f"{key}_control"] = leader.control
            leader.allocate(SLOTS, MAX_LEN)
            results[f"{key}_warmup"] = leader.warmup(4, 8)  # reaches every rank; no graphs to capture on CPU
            bad = [(torch.tensor([[1]]), torch.tensor([0]), torch.tensor([SLOTS])),  # no such slot
                   (torch.tensor([[1, 2]]), torch.tensor([MAX_LEN - 1]), torch.tensor([0])),  # past the cache
                   (torch.tensor([[inner.info.vocab_size]]), torch.tensor([0]), torch.tensor([0]))]  # not a token
            results[f"{key}_rejected"] = 0
            for call in bad:  # refused on rank 0 before anything is broadcast: the group stays usable
                try:
                    leader.forward(*call)
                except AssertionError:
                    results[f"{key}_rejected"] += 1
            results[key] = script(leader, inner.info.vocab_size)
            time.sleep(3.0)  # idle past the 2 s control timeout: heartbeats keep the follower waiting
            results[f"{key}_after_idle"] = leader.forward(torch.tensor([[1, 2]]), torch.tensor([0]), torch.tensor([3]))
            leader.allocate(2, LONG + 8)  # re-allocation reaches the followers too
            results[f"{key}_long_prefill"] = leader.forward(long_prompt(), torch.tensor([0]), torch.tensor([1]),
                                                            LONG - 4)
            leader.close()
        else:
            follow(inner, tp)

    # The control channel: a Unix socket to each follower (what "auto" takes on one host), then gloo broadcasts.
    driven(lambda: load_tensor_parallel_model(models[first], tp), "driven", "auto")
    if importlib.util.find_spec("pipeline.models.graphs") is not None:  # the static-shape path (CPU: no capture)
        from pipeline.models.graphs import GraphConfig

        static = GraphConfig(graphs=False, compile=False, **GRAPH_BUCKETS)
        graph_runner = []
        driven(lambda: graph_runner.append(tensor_parallel_graphs(load_tensor_parallel_model(models[first], tp),
                                                                  static)) or graph_runner[0], "graphs", "gloo")
        results["graph_calls"] = graph_runner[0].stats.graph_calls
        for kind in ("fused", "ring"):  # refused before any collective: the fused layer needs CUDA; no such kind
            try:
                tensor_parallel_graphs(graph_runner[0].runner, static, kind)
                results[f"refused_{kind}"] = None
            except ValueError as err:
                results[f"refused_{kind}"] = str(err)

    # The follower is lost: rank 0's next call must fail (not hang) and break the group for good.
    runner = load_tensor_parallel_model(models[first], tp)
    if rank == 0:
        failures: list[BaseException] = []
        leader = TensorParallelRunner(runner, tp, heartbeat_s=None, on_failure=failures.append)
        leader.allocate(SLOTS, MAX_LEN)
        save_atomic(results, out / "results.pt")
        (out / "ready_to_kill").touch()
        while not (out / "killed").exists():
            time.sleep(0.02)
        t0 = time.monotonic()
        try:
            leader.forward(torch.tensor([[1, 2, 3]]), torch.tensor([0]), torch.tensor([0]))
            outcome = "no error"
        except TensorParallelError as err:
            outcome = f"TensorParallelError: {err}"
        elapsed = time.monotonic() - t0
        try:
            leader.forward(torch.tensor([[1]]), torch.tensor([0]), torch.tensor([0]))
            again = "no error"
        except TensorParallelError as err:
            again = f"TensorParallelError: {err}"
        save_atomic({"outcome": outcome, "elapsed_s": elapsed, "again": again, "on_failure_calls": len(failures)},
                   out / "loss.pt")
    else:
        follow(runner, tp)  # killed by the test while waiting here


def leader_lost(rank: int, world_size: int, init: str, model: str, hang: bool, control: str, out_dir: str) -> None:
    """Rank 0 is killed by the test (hang=False) or stops sending anything, heartbeats included (hang=True):
    the follower's follow() must raise within the control timeout, not wait forever."""
    from pipeline.models.tensor_parallel import (
        TensorParallelError,
        TensorParallelRunner,
        follow,
        init_tensor_parallel,
        load_tensor_parallel_model,
    )

    out = Path(out_dir)
    tp = init_tensor_parallel(rank, world_size, init, "cpu", collective_timeout_s=20, control_timeout_s=1.5)
    runner = load_tensor_parallel_model(model, tp)
    if rank == 0:
        leader = TensorParallelRunner(runner, tp, heartbeat_s=None, control=control)
        leader.allocate(SLOTS, MAX_LEN)
        leader.forward(torch.tensor([[1, 2, 3]]), torch.tensor([0]), torch.tensor([0]))
        (out / "ready_to_kill").touch()
        time.sleep(60)  # killed (or silent) here
    else:
        t0 = None
        try:
            (out / "following").touch()
            t0 = time.monotonic()
            follow(runner, tp)
            outcome = "returned"
        except TensorParallelError as err:
            outcome = f"TensorParallelError: {err}"
        save_atomic({"outcome": outcome, "since_follow_s": time.monotonic() - t0}, out / "follower.pt")
