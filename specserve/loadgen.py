"""Load generator: N concurrent streaming clients against an OpenAI-compatible HTTP API.

Closed loop: each of `concurrency` clients sends a request, reads its SSE stream to the end, and sends the
next, until `num_requests` have been sent, `duration_s` has passed (both bounds are enforced) or the caller's `stop`
event is set (requests in flight then finish). Per request
it records the time of the first content chunk (TTFT), the gaps between content chunks (inter-token
latency, ITL: speculative decoding streams several tokens per chunk, so this is the gap a reader sees),
the usage and specserve's `speculation` stats from the final chunk, and errors. The queue wait of a request
(how long it waited for a KV-cache slot, part of its TTFT) is the server's own measure, `queue_wait_s` in those
stats; target replays (`target_replays`: prompts fed again) come from there too. Refusals (HTTP 429) are counted
apart from other failures.

Outputs (in `out_dir`): summary.json (aggregates), requests.jsonl (one record per request), and PNGs:
ttft.png, itl.png, queue_wait.png (distributions), latency.png (TTFT and queue wait of each request over the
run), tokens_per_s.png (output tokens/s over time, 1 s bins), acceptance.png (per-request acceptance rate and
mean accepted tokens per step).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import httpx
from tqdm import tqdm

DEFAULT_PROMPTS = (
    "Explain how a hash map handles collisions.",
    "Write a short poem about the sea at night.",
    "List three differences between TCP and UDP.",
    "Translate to German: The weather is nice today and we are going for a walk.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What is 17 times 23? Show your reasoning step by step.",
    "Give me a Python function that reverses a linked list.",
    "Describe the water cycle to a ten-year-old.",
)


@dataclass
class LoadConfig:
    url: str = "http://127.0.0.1:8000"  # base URL; /v1/... is appended
    model: str | None = None  # None: the first model of GET /v1/models
    concurrency: int = 4  # clients streaming at once
    num_requests: int = 32  # total requests (upper bound)
    duration_s: float | None = None  # stop sending after this many seconds (upper bound)
    max_tokens: int = 64
    temperature: float = 0.0
    num_draft_tokens: int | None = None  # K, sent as the `speculation` extension; None: the server's default
    endpoint: str = "chat"  # "chat" (/v1/chat/completions) or "completions" (/v1/completions)
    ignore_eos: bool = False  # keep generating to max_tokens (steady lengths for benchmarks)
    seed: int = 0  # picks prompts, and is sent per request (seed + index) so runs are reproducible
    timeout_s: float = 300.0  # per request
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be 'chat' or 'completions', got {self.endpoint!r}")


@dataclass
class RequestRecord:
    index: int
    client: int
    prompt_chars: int
    start: float  # seconds since the run started
    ok: bool = False
    error: str | None = None
    status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # content chunks, seconds since request start
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    speculation: dict[str, Any] | None = None

    @property
    def queue_wait_s(self) -> float | None:
        """Seconds the server kept the request waiting for a KV-cache slot (its own measure)."""
        return _spec_get(self.speculation or {}, "queue_wait_s") if self.ok else None

    @property
    def itl_s(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> float | None:
        """(last chunk - first chunk) / (tokens - 1): time per output token after the first."""
        if not self.chunk_times or not self.completion_tokens or self.completion_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.completion_tokens - 1)


def load_prompts(path: str | Path | None) -> list[str]:
    """Prompts from a .jsonl file (Spec-Bench `turns[0]`, or `prompt` / `text`), a text file (one per line),
    or the built-in list."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    p = Path(path)
    prompts: list[str] = []
    if p.suffix == ".jsonl":
        for line in p.read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            text = row["turns"][0] if "turns" in row else row.get("prompt") or row.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{p}: a row has no 'turns', 'prompt' or 'text' string: {line[:80]}")
            prompts.append(text)
    else:
        prompts = [line for line in p.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"no prompts in {p}")
    return prompts


def _body(config: LoadConfig, model: str, prompt: str, index: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "max_tokens": config.max_tokens, "temperature": config.temperature,
        "stream": True, "stream_options": {"include_usage": True}, "seed": config.seed + index,
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.num_draft_tokens is not None:
        body["speculation"] = {"num_draft_tokens": config.num_draft_tokens}
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(event: dict[str, Any]) -> str | None:
    choices = event.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content")
    return choice.get("text")


async def _one_request(client: Any, config: LoadConfig, model: str, prompt: str, rec: RequestRecord,
                       t0: float) -> None:
    path = "/v1/chat/completions" if config.endpoint == "chat" else "/v1/completions"
    start = time.perf_counter()
    rec.start = start - t0
    try:
        async with client.stream("POST", path, json=_body(config, model, prompt, rec.index)) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:200]}"
                return
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    rec.error = f"stream error: {event['error'].get('message', event['error'])}"[:300]
                    return
                text = _chunk_text(event)
                if text:
                    now = time.perf_counter() - start
                    if rec.ttft_s is None:
                        rec.ttft_s = now
                    rec.chunk_times.append(now)
                choices = event.get("choices") or []
                if choices and choices[0].get("finish_reason"):
                    rec.finish_reason = choices[0]["finish_reason"]
                if event.get("usage"):
                    rec.prompt_tokens = event["usage"].get("prompt_tokens")
                    rec.completion_tokens = event["usage"].get("completion_tokens")
                if event.get("speculation") is not None:
                    rec.speculation = event["speculation"]
            if not done:
                rec.error = "stream ended without [DONE]"
                return
            rec.ok = True
    except Exception as err:  # noqa: BLE001 - every failure is counted, the run goes on
        rec.error = f"{type(err).__name__}: {err}"[:300]
    finally:
        rec.e2e_s = time.perf_counter() - start


async def _resolve_model(client: Any, config: LoadConfig) -> str:
    if config.model:
        return config.model
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{config.url}/v1/models lists no model: pass --model")
    return data[0]["id"]


async def run_load(config: LoadConfig, prompts: Sequence[str], progress: bool = True,
                   stop: threading.Event | None = None) -> tuple[list[RequestRecord], float, str]:
    """Run the load; return (records in send order, wall time of the run in s, model id). `stop` (set from another
    thread): send no further request."""
    rng = random.Random(config.seed)
    order = [rng.randrange(len(prompts)) for _ in range(config.num_requests)]
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.concurrency + 1, max_keepalive_connections=config.concurrency)
    timeout = httpx.Timeout(config.timeout_s, connect=10.0)
    records: list[RequestRecord] = []
    bar = None
    if progress:
        bar = tqdm(total=config.num_requests, unit="req", desc="load", dynamic_ncols=True)
    async with httpx.AsyncClient(base_url=config.url, headers=headers, limits=limits, timeout=timeout) as client:
        model = await _resolve_model(client, config)
        t0 = time.perf_counter()
        deadline = t0 + config.duration_s if config.duration_s else math.inf
        next_index = 0
        tokens = 0

        async def worker(client_id: int) -> None:
            nonlocal next_index, tokens
            while (next_index < config.num_requests and time.perf_counter() < deadline
                   and not (stop is not None and stop.is_set())):
                i = next_index
                next_index += 1
                prompt = prompts[order[i]]
                rec = RequestRecord(index=i, client=client_id, prompt_chars=len(prompt), start=0.0)
                records.append(rec)
                try:
                    await asyncio.wait_for(_one_request(client, config, model, prompt, rec, t0),
                                           timeout=config.timeout_s)
                except asyncio.TimeoutError:
                    rec.error = rec.error or f"timed out after {config.timeout_s} s"
                    rec.ok = False
                tokens += rec.completion_tokens or 0
                if bar is not None:
                    bar.update(1)
                    elapsed = time.perf_counter() - t0
                    bar.set_postfix(ok=sum(r.ok for r in records), tok_s=f"{tokens / max(elapsed, 1e-9):.1f}")

        await asyncio.gather(*(worker(c) for c in range(config.concurrency)))
        wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    records.sort(key=lambda r: r.index)
    return records, wall, model


# -- aggregation ------------------------------------------------------------------------------------------

def _stats(values: Iterable[float]) -> dict[str, float] | None:
    v = sorted(values)
    if not v:
        return None

    def pct(q: float) -> float:  # linear interpolation, as numpy's default
        pos = (len(v) - 1) * q
        lo, hi = math.floor(pos), math.ceil(pos)
        return v[lo] + (v[hi] - v[lo]) * (pos - lo)

    return {"count": len(v), "mean": sum(v) / len(v), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99),
            "min": v[0], "max": v[-1]}


def _total(values: Iterable[Any]) -> int | None:
    """The sum of the numbers among `values`; None when there is none (a server that does not report them)."""
    numbers = [v for v in values if isinstance(v, (int, float))]
    return int(sum(numbers)) if numbers else None


def _spec_get(spec: dict[str, Any], *names: str) -> float | None:
    for n in names:
        if isinstance(spec.get(n), (int, float)):
            return float(spec[n])
    return None


def speculation_totals(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """Sum specserve's per-request speculation stats: drafted, accepted, steps -> rates."""
    drafted = accepted = steps = 0.0
    seen = 0
    for r in records:
        if not r.ok or not r.speculation:
            continue
        d = _spec_get(r.speculation, "drafted", "draft_tokens")
        a = _spec_get(r.speculation, "accepted", "accepted_tokens")
        s = _spec_get(r.speculation, "target_passes", "steps")
        if d is None or a is None:
            continue
        seen += 1
        drafted += d
        accepted += a
        steps += s or 0
    if not seen:
        return None
    out: dict[str, Any] = {"requests": seen, "drafted": drafted, "accepted": accepted,
                           "acceptance_rate": accepted / drafted if drafted else None}
    if steps:
        out["target_passes"] = steps
        # Tokens per target pass: accepted + one recovered/bonus token per step.
        out["mean_accepted_tokens"] = (accepted + steps) / steps
    by_position = acceptance_by_position(records)
    if by_position:
        out["acceptance_by_position"] = by_position
    return out


def acceptance_by_position(records: Sequence[RequestRecord]) -> list[float] | None:
    """Mean over requests of each request's acceptance rate at draft position i (server's
    `acceptance_by_position`); a request counts at the positions it drafted."""
    sums: list[float] = []
    counts: list[int] = []
    for r in records:
        rates = (r.speculation or {}).get("acceptance_by_position") if r.ok else None
        if not isinstance(rates, list):
            continue
        for i, rate in enumerate(rates):
            if i == len(sums):
                sums.append(0.0)
                counts.append(0)
            sums[i] += float(rate)
            counts[i] += 1
    return [s / c for s, c in zip(sums, counts)] or None


def per_request_acceptance(records: Sequence[RequestRecord]) -> tuple[list[float], list[float]]:
    rates, taus = [], []
    for r in records:
        if not r.ok or not r.speculation:
            continue
        d = _spec_get(r.speculation, "drafted", "draft_tokens")
        a = _spec_get(r.speculation, "accepted", "accepted_tokens")
        s = _spec_get(r.speculation, "target_passes", "steps")
        if d:
            rates.append(a / d)
        if s:
            taus.append((a + s) / s)
    return rates, taus


def token_timeline(records: Sequence[RequestRecord], bin_s: float = 1.0) -> list[tuple[float, float]]:
    """(bin start in s, output tokens/s in that bin). A request's tokens are spread evenly over its
    content chunks (the stream carries text, not token counts)."""
    events: list[tuple[float, float]] = []
    for r in records:
        if not r.chunk_times or not r.completion_tokens:
            continue
        per_chunk = r.completion_tokens / len(r.chunk_times)
        events.extend((r.start + t, per_chunk) for t in r.chunk_times)
    if not events:
        return []
    end = max(t for t, _ in events)
    bins = [0.0] * (int(end // bin_s) + 1)
    for t, n in events:
        bins[int(t // bin_s)] += n
    return [(i * bin_s, n / bin_s) for i, n in enumerate(bins)]


def summarize(records: Sequence[RequestRecord], wall_s: float, config: LoadConfig, model: str,
              ) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = (r.error or "unknown")[:120]
            errors[key] = errors.get(key, 0) + 1
    completion = sum(r.completion_tokens or 0 for r in ok)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    return {
        "config": asdict(config) | {"api_key": None},
        "model": model,
        "wall_s": wall_s,
        "requests": {"sent": len(records), "ok": len(ok), "failed": len(records) - len(ok),
                     "rejected": sum(r.status == 429 for r in records), "errors": errors},
        "throughput": {
            "requests_per_s": len(ok) / wall_s if wall_s else None,
            "output_tokens_per_s": completion / wall_s if wall_s else None,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
        },
        "ttft_s": _stats(r.ttft_s for r in ok if r.ttft_s is not None),
        "queue_wait_s": _stats(r.queue_wait_s for r in ok if r.queue_wait_s is not None),
        "target_replays": _total(r.speculation.get("target_replays") for r in ok if r.speculation),
        "itl_s": _stats(g for r in ok for g in r.itl_s),
        "tpot_s": _stats(r.tpot_s for r in ok if r.tpot_s is not None),
        "e2e_s": _stats(r.e2e_s for r in ok if r.e2e_s is not None),
        "tokens_per_chunk": (completion / sum(len(r.chunk_times) for r in ok)
                             if ok and any(r.chunk_times for r in ok) else None),
        "speculation": speculation_totals(records),
    }


def write_plots(records: Sequence[RequestRecord], out_dir: Path) -> list[Path]:
    import matplotlib  # optional (the serve extra), and slow to import: only when plots are asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.ok]
    paths: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)

    def hist_ms(values: list[float], title: str, name: str) -> None:
        fig, ax = plt.subplots(figsize=(6, 4))
        if values:
            ms = [v * 1000 for v in values]
            ax.hist(ms, bins=min(50, max(5, len(ms) // 2)), color="tab:blue", alpha=0.8)
            for q, style in ((0.5, "-"), (0.9, "--"), (0.99, ":")):
                s = _stats(ms)
                assert s is not None
                ax.axvline(s[f"p{int(q * 100)}"], color="k", linestyle=style, label=f"p{int(q * 100)}")
            ax.legend()
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
        ax.set_title(f"{title} (n={len(values)})")
        save(fig, name)

    hist_ms([r.ttft_s for r in ok if r.ttft_s is not None], "Time to first token", "ttft.png")
    hist_ms([g for r in ok for g in r.itl_s], "Inter-token latency (gap between chunks)", "itl.png")
    waits = [r.queue_wait_s for r in ok if r.queue_wait_s is not None]
    hist_ms(waits, "Queue wait for a KV-cache slot (server)", "queue_wait.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    timed = sorted((r for r in ok if r.ttft_s is not None), key=lambda r: r.start)
    if timed:
        ax.scatter([r.start for r in timed], [r.ttft_s for r in timed], s=12, label="TTFT", color="tab:blue")
        queued = [r for r in timed if r.queue_wait_s is not None]
        if queued:
            ax.scatter([r.start for r in queued], [r.queue_wait_s for r in queued], s=12, marker="x",
                       label="queue wait", color="tab:red")
        ttft = _stats(r.ttft_s for r in timed)
        assert ttft is not None
        for q, style in (("p50", "-"), ("p99", ":")):
            ax.axhline(ttft[q], color="tab:blue", linestyle=style, linewidth=0.8, label=f"TTFT {q}")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("request sent at (s since start)")
    ax.set_ylabel("s")
    ax.set_title("TTFT and queue wait per request")
    save(fig, "latency.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    timeline = token_timeline(records)
    if timeline:
        ax.step([t for t, _ in timeline], [v for _, v in timeline], where="post")
    ax.set_xlabel("s since start")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput over time (1 s bins)")
    save(fig, "tokens_per_s.png")

    rates, taus = per_request_acceptance(records)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    if rates:
        ax1.hist(rates, bins=20, range=(0, 1), color="tab:green", alpha=0.8)
    ax1.set_xlabel("accepted / drafted")
    ax1.set_ylabel("requests")
    ax1.set_title(f"Acceptance rate per request (n={len(rates)})")
    if taus:
        ax2.hist(taus, bins=20, color="tab:orange", alpha=0.8)
    ax2.set_xlabel("tokens per target pass")
    ax2.set_title("Mean accepted tokens per request")
    by_position = acceptance_by_position(records)
    if by_position:
        ax3.bar(range(len(by_position)), by_position, color="tab:purple", alpha=0.8)
        ax3.set_ylim(0, 1)
    ax3.set_xlabel("draft position")
    ax3.set_ylabel("acceptance rate")
    ax3.set_title("Acceptance by draft position (mean over requests)")
    if not rates:
        ax1.text(0.5, 0.5, "no speculation stats", ha="center", va="center", transform=ax1.transAxes)
    save(fig, "acceptance.png")
    return paths


def run(config: LoadConfig, prompts: Sequence[str], out_dir: str | Path | None, progress: bool = True,
        plots: bool = True, stop: threading.Event | None = None) -> dict[str, Any]:
    """Run the load, write the outputs, return the summary. `stop`: as for `run_load`."""
    records, wall, model = asyncio.run(run_load(config, prompts, progress=progress, stop=stop))
    summary = summarize(records, wall, config, model)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "requests.jsonl", "w") as f:
            for r in records:
                f.write(json.dumps(asdict(r) | {"itl_s": r.itl_s, "tpot_s": r.tpot_s}) + "\n")
        if plots:
            summary["plots"] = [str(p) for p in write_plots(records, out)]
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
