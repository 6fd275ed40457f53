"""Soak: `specserve serve` under a steady streaming load for a long time, watching for growth.

    python -m ops.soak                                   # 30 minutes, 16 streams, a sample every 10 s
    nice -n 19 python -m ops.soak --duration-s 1800 --out load-out/soak

What it runs: a redis-server of its own on a free loopback port (the request store; the soak needs a client
connection to it, which the embedded server keeps inside its replica), then `specserve serve` with the demo
defaults on free loopback ports (HTTP and metrics) and `request_ttl_s` set short (`--ttl-s`, default 60) through
an AppConfig file, then `--concurrency` closed-loop streaming clients (specserve/loadgen.py) for `--duration-s`.
After the load it keeps sampling for the TTL plus `--settle-s`, so expired request state shows up as keys gone.

Sampled every `--interval-s`:
- RSS of every process of the app: the `specserve serve` driver and its whole process tree (Ray's GCS, raylet,
  agents, every worker and Serve replica), by process name, and their total;
- the Redis server's RSS, `INFO memory` used_memory and `DBSIZE` (keys);
- slots in use: the sum of `ray_specserve_active_requests` (requests holding a batch slot) scraped from the
  metrics port.

Writes to `--out` (an ignored folder): samples.csv (long format: t_s, phase, series, value), soak.png,
summary.md (the table printed at the end: start / end / max per series and the slope over the load after a
warm-up), result.json (the checks, the metrics port's listen addresses), metrics.txt (the last /metrics scrape
that held specserve's metrics) and the load generator's own outputs under load/. Exit status 1 when the keys do
not return to `--max-keys-left` after the TTL, slots stay in use after the load, or a request failed.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import redis
from prometheus_client.parser import text_string_to_metric_families

from deployments.embedded_redis import find_redis_server
from specserve import loadgen

MB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Sample:
    t_s: float  # seconds since the load started (negative before it)
    phase: str  # "load" | "after"
    values: dict[str, float] = field(default_factory=dict)  # series -> value


def process_name(p: psutil.Process) -> str:
    """A stable name for a process of the app: Ray workers by their title (ray::ServeReplica:app:Target), the rest
    by executable (gcs_server, raylet, python -m ...)."""
    cmd = p.cmdline()
    if cmd and cmd[0].startswith("ray::"):  # the title names the running method too: ray::TargetWorker.verify
        return cmd[0].split()[0].split(".")[0]
    exe = Path(cmd[0]).name if cmd else p.name()
    if exe.startswith("python") and len(cmd) > 1:
        script = next((a for a in cmd[1:] if not a.startswith("-")), "")
        module = cmd[cmd.index("-m") + 1] if "-m" in cmd[:-1] else ""
        return f"python {module or Path(script).name}"
    return exe


def tree_rss(root: psutil.Process) -> dict[str, float]:
    """RSS in MB of `root` and every descendant, by process name (same names summed, with a count suffix when
    there are several), plus 'rss total'."""
    out: dict[str, float] = {}
    counts: dict[str, int] = {}
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            name, rss = process_name(p), p.memory_info().rss / MB
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        counts[name] = counts.get(name, 0) + 1
        out[f"rss {name}"] = out.get(f"rss {name}", 0.0) + rss
    out["rss total"] = sum(out.values())
    out["processes"] = float(sum(counts.values()))
    return out


def scrape(metrics_url: str) -> str | None:
    try:
        return httpx.get(metrics_url, timeout=10).text
    except httpx.HTTPError:
        return None


def slots_in_use(text: str | None) -> float:
    """Sum of ray_specserve_active_requests over every replica; NaN when not exported (yet)."""
    if text is None:
        return math.nan
    values = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
              if s.name == "ray_specserve_active_requests"]
    return sum(values) if values else math.nan


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t_s, value) points, per hour; NaN with fewer than 2 finite points."""
    pts = [(t, v) for t, v in points if not math.isnan(v)]
    if len(pts) < 2:
        return math.nan
    n = len(pts)
    mt, mv = sum(t for t, _ in pts) / n, sum(v for _, v in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    if var == 0:
        return math.nan
    return sum((t - mt) * (v - mv) for t, v in pts) / var * 3600


def summarize(samples: list[Sample], warmup_s: float) -> list[dict]:
    """Per series: value at the first and last load sample, max, slope over the load after `warmup_s`, and the
    last value after the load."""
    series = sorted({k for s in samples for k in s.values}, key=lambda k: (not k.startswith("rss total"), k))
    rows = []
    for name in series:
        load = [(s.t_s, s.values.get(name, math.nan)) for s in samples if s.phase == "load"]
        after = [s.values.get(name, math.nan) for s in samples if s.phase == "after"]
        finite = [v for _, v in load if not math.isnan(v)]
        rows.append({
            "series": name,
            "start": finite[0] if finite else math.nan,
            "end": finite[-1] if finite else math.nan,
            "max": max(finite) if finite else math.nan,
            "slope_per_h": slope_per_hour([(t, v) for t, v in load if t >= warmup_s]),
            "after": after[-1] if after else math.nan,
        })
    return rows


def table(rows: list[dict]) -> str:
    def f(v: float) -> str:
        return "-" if math.isnan(v) else (f"{v:,.1f}" if abs(v) < 1e5 else f"{v:,.0f}")

    lines = ["| series | start | end of load | max | slope per hour (after warm-up) | after TTL |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['series']} | {f(r['start'])} | {f(r['end'])} | {f(r['max'])} | {f(r['slope_per_h'])} "
                     f"| {f(r['after'])} |")
    return "\n".join(lines)


def plot(samples: list[Sample], load_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(10, 12), sharex=True)
    t = [s.t_s / 60 for s in samples]

    def line(ax, name: str, scale: float = 1.0, **kw) -> None:
        ax.plot(t, [s.values.get(name, math.nan) * scale for s in samples], **kw)

    names = sorted({k for s in samples for k in s.values if k.startswith("rss ") and k != "rss total"})
    top = sorted(names, key=lambda k: -max(s.values.get(k, 0.0) for s in samples))[:8]
    line(axes[0], "rss total", label="total", linewidth=2, color="black")
    for name in top:
        line(axes[0], name, label=name[4:][:40])
    axes[0].set_ylabel("RSS (MB)")
    axes[0].legend(fontsize=7, loc="upper left")
    line(axes[1], "redis used_memory MB", label="used_memory")
    line(axes[1], "rss redis-server", label="redis-server RSS")
    axes[1].set_ylabel("Redis (MB)")
    axes[1].legend(fontsize=7)
    line(axes[2], "redis keys")
    axes[2].set_ylabel("Redis keys")
    line(axes[3], "slots in use")
    axes[3].set_ylabel("slots in use")
    axes[3].set_xlabel("minutes since the load started")
    for ax in axes:
        ax.axvline(load_s / 60, color="grey", linestyle="--", linewidth=1)
        ax.grid(alpha=0.3)
    axes[0].set_title("soak: the load ends at the dashed line")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class App:
    """redis-server and `specserve serve` as child processes, stopped in reverse order."""

    def __init__(self, out: Path, ttl_s: int, extra_args: list[str]):
        self.out = out
        self.redis_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.ttl_s, self.extra_args = ttl_s, extra_args
        self.redis: subprocess.Popen | None = None
        self.serve: subprocess.Popen | None = None
        self.last_scrape = ""  # the last /metrics text that held specserve's metrics
        self._redis_dir = tempfile.TemporaryDirectory(prefix="soak-redis-")

    def start(self, attempts: int = 3) -> None:
        """Start both; `specserve serve` up to `attempts` times (on a loaded machine at nice 19, Ray's raylet can
        miss its fixed 30 s start-up window)."""
        self._start_redis()
        for attempt in range(1, attempts + 1):
            try:
                self._start_serve()
                return
            except RuntimeError as err:
                if attempt == attempts:
                    raise
                print(f"soak: {err}; starting it again ({attempt + 1} of {attempts})", flush=True)
                (self.out / "serve.log").rename(self.out / f"serve.{attempt}.log")

    def _start_redis(self) -> None:
        self.redis = subprocess.Popen(
            [find_redis_server(), "--bind", "127.0.0.1", "--port", str(self.redis_port), "--save", "",
             "--appendonly", "no", "--dir", self._redis_dir.name],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _start_serve(self, timeout_s: float = 900) -> None:
        config = self.out / "app.yaml"
        config.write_text(f"request_ttl_s: {self.ttl_s}\n")
        log = open(self.out / "serve.log", "w")
        self.serve = subprocess.Popen(
            [sys.executable, "-m", "specserve", "serve", "--config", str(config), "--port", str(self.http_port),
             "--metrics-port", str(self.metrics_port), "--redis-url", self.redis_url, *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.serve.poll() is not None:
                raise RuntimeError(f"specserve serve exited ({self.serve.returncode}): see {self.out / 'serve.log'}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise TimeoutError(f"specserve serve not ready after {timeout_s} s: see {self.out / 'serve.log'}")

    def redis_client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, socket_timeout=5)

    def stop(self) -> None:
        if self.serve is not None and self.serve.poll() is None:
            self.serve.send_signal(signal.SIGINT)
            try:
                self.serve.wait(60)
            except subprocess.TimeoutExpired:
                self.serve.kill()
                self.serve.wait(10)
        if self.redis is not None and self.redis.poll() is None:
            self.redis.terminate()
            self.redis.wait(10)
        self._redis_dir.cleanup()


def sample(app: App, client: redis.Redis, t_s: float, phase: str) -> Sample:
    s = Sample(t_s, phase)
    if app.serve is not None:
        s.values.update(tree_rss(psutil.Process(app.serve.pid)))
    try:
        info = client.info("memory")
        s.values["redis used_memory MB"] = info["used_memory"] / MB
        s.values["redis keys"] = float(client.dbsize())
    except redis.RedisError:
        s.values["redis used_memory MB"] = s.values["redis keys"] = math.nan
    if app.redis is not None:
        try:
            s.values["rss redis-server"] = psutil.Process(app.redis.pid).memory_info().rss / MB
        except psutil.NoSuchProcess:
            pass
    text = scrape(app.metrics_url)
    s.values["slots in use"] = slots_in_use(text)
    if text is not None and "ray_specserve_" in text:
        app.last_scrape = text
    return s


def listen_addresses(port: int) -> list[str]:
    """Addresses something listens on at `port` (e.g. ['127.0.0.1'])."""
    return sorted({c.laddr.ip for c in psutil.net_connections("tcp")
                   if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN})


def write_csv(samples: list[Sample], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "phase", "series", "value"])
        for s in samples:
            for name, value in sorted(s.values.items()):
                w.writerow([f"{s.t_s:.1f}", s.phase, name, "" if math.isnan(value) else f"{value:.3f}"])


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    app = App(out, args.ttl_s, args.serve_arg or [])
    samples: list[Sample] = []
    print(f"soak: starting redis-server and specserve serve (log: {out / 'serve.log'}) ...", flush=True)
    try:
        app.start()
        client = app.redis_client()
        metrics_listen = listen_addresses(app.metrics_port)
        print(f"soak: serving at {app.url}, metrics {app.metrics_url}; {args.concurrency} streams for "
              f"{args.duration_s:.0f} s, a sample every {args.interval_s:.0f} s", flush=True)
        config = loadgen.LoadConfig(url=app.url, concurrency=args.concurrency, num_requests=10**7,
                                    duration_s=args.duration_s, max_tokens=args.max_tokens,
                                    temperature=args.temperature, timeout_s=300.0)
        holder: dict = {}
        load = threading.Thread(target=lambda: holder.update(summary=loadgen.run(
            config, loadgen.load_prompts(None), out / "load", progress=False)), daemon=True)
        t0 = time.time()
        load.start()
        while load.is_alive():
            samples.append(sample(app, client, time.time() - t0, "load"))
            load.join(args.interval_s)
        load_s = time.time() - t0
        load_summary = holder.get("summary") or {}
        print(f"soak: load done after {load_s:.0f} s: {load_summary.get('requests')}; waiting out the TTL "
              f"({args.ttl_s} s) + {args.settle_s:.0f} s", flush=True)
        until = time.time() + args.ttl_s + args.settle_s
        while time.time() < until:
            samples.append(sample(app, client, time.time() - t0, "after"))
            time.sleep(min(args.interval_s, max(0.0, until - time.time())))
        samples.append(sample(app, client, time.time() - t0, "after"))
    finally:
        app.stop()

    write_csv(samples, out / "samples.csv")
    plot(samples, load_s, out / "soak.png")
    rows = summarize(samples, warmup_s=min(300.0, load_s / 5))
    last = samples[-1].values
    keys_left, slots_left = last.get("redis keys", math.nan), last.get("slots in use", math.nan)
    checks = [
        (f"Redis keys {args.ttl_s + args.settle_s:.0f} s after the load: {keys_left:.0f} "
         f"(<= {args.max_keys_left})", keys_left <= args.max_keys_left),
        (f"slots in use after the load: {slots_left:.0f} (0 or not exported)",
         math.isnan(slots_left) or slots_left == 0),
        (f"requests: {load_summary.get('requests')}", bool(load_summary)
         and load_summary["requests"].get("failed", 1) == 0),
    ]
    load_avg = os.getloadavg()
    text = (f"soak: {args.concurrency} streams for {load_s:.0f} s, samples every {args.interval_s:.0f} s, "
            f"request_ttl_s {args.ttl_s}; load average at the end (1/5/15 min): "
            f"{load_avg[0]:.2f} / {load_avg[1]:.2f} / {load_avg[2]:.2f}\n"
            f"tokens/s {load_summary.get('throughput', {}).get('output_tokens_per_s', '-')}\n\n"
            f"RSS and Redis memory in MB; slope from the first {min(300.0, load_s / 5):.0f} s on.\n\n"
            + table(rows) + "\n\n" + "\n".join(f"{'ok  ' if ok else 'FAIL'} {what}" for what, ok in checks) + "\n")
    (out / "summary.md").write_text(text)
    (out / "metrics.txt").write_text(app.last_scrape)
    (out / "result.json").write_text(json.dumps({
        "ok": all(ok for _, ok in checks), "checks": [{"what": w, "ok": ok} for w, ok in checks],
        "load_s": load_s, "keys_left": keys_left, "slots_left": None if math.isnan(slots_left) else slots_left,
        "max_slots": max((s.values.get("slots in use", 0.0) for s in samples if s.phase == "load"
                          and not math.isnan(s.values.get("slots in use", math.nan))), default=None),
        "metrics_url": app.metrics_url, "metrics_listen": metrics_listen, "load": load_summary.get("requests"),
        "serve_exit": None if app.serve is None else app.serve.returncode,  # after Ctrl-C (SIGINT): 0
        "load_average": load_avg}, indent=1))
    print(text)
    print(f"soak: wrote {out / 'samples.csv'}, {out / 'soak.png'}, {out / 'summary.md'}")
    return 0 if all(ok for _, ok in checks) else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ops.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=1800.0, help="load duration (default 30 min)")
    p.add_argument("--interval-s", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--concurrency", type=int, default=16, help="streaming clients")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7, help="sampled, seeded per request")
    p.add_argument("--ttl-s", type=int, default=60, help="request_ttl_s of the app (its minimum is 10)")
    p.add_argument("--settle-s", type=float, default=30.0, help="extra wait after the TTL before the last sample")
    p.add_argument("--max-keys-left", type=int, default=0, help="keys allowed after TTL + settle")
    p.add_argument("--out", default="load-out/soak", help="output folder (ignored by git)")
    p.add_argument("--serve-arg", action="append", help="extra `specserve serve` argument (repeatable)")
    return p


if __name__ == "__main__":
    raise SystemExit(run(build_parser().parse_args()))
