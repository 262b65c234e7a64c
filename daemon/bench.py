"""Throughput and latency benchmark: a running server over HTTP, the in-process engine, or both.

Server mode sends C concurrent streaming chat requests per concurrency level and
reports aggregate generated tok/s (usage completion tokens / wall time of the
batch), TTFT and inter-chunk latency percentiles. Engine mode tokenizes the same
prompts, submits them straight to an ``EngineCore`` and steps it until idle, so
``--both`` shows how much of the engine's throughput the HTTP pipeline keeps.

    mlxd bench --url http://127.0.0.1:8000 --concurrency 1,8,32
    mlxd bench --engine --max-tokens 64
    mlxd bench --both --url http://127.0.0.1:8000 --json
    python -m mlxd.scripts.bench ...  (the same, from a checkout)

Nothing here imports MLX at module level: engine mode imports it when it runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

TOPICS = (
    "a lighthouse keeper who finds a message in a bottle",
    "a robot learning to paint",
    "a dragon who is afraid of heights",
    "two rival bakers in a small mountain town",
    "a detective solving a mystery on a night train",
    "a child who can talk to trees",
    "the last library on Mars",
    "a sailor lost in a storm near an unknown island",
    "a musician who hears colors",
    "an astronaut stranded on the moon",
    "a cat that becomes mayor of a city",
    "a time traveler stuck in the year 1850",
    "a knight who refuses to fight",
    "a scientist who shrinks herself by accident",
    "a village that appears only once every hundred years",
    "a ghost who haunts a bookshop",
)


def prompts(n: int) -> list[str]:
    """``n`` prompts that make the model ramble, varied so no two requests are alike."""
    return [
        f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}. "
        f"Describe every scene and character at length. (Story number {i + 1}.)"
        for i in range(n)
    ]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class RequestResult:
    """Timings of one request, in seconds from its own send."""

    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    e2e: float = 0.0
    tokens: int = 0
    error: str | None = None


@dataclass
class LevelResult:
    """One (mode, concurrency) row of the report."""

    mode: str
    concurrency: int
    wall_s: float
    requests: list[RequestResult]

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.requests if r.error is None]

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.ok)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else math.nan

    def summary(self) -> dict:
        ttfts = [r.ttft for r in self.ok if r.ttft is not None]
        gaps = [g for r in self.ok for g in r.gaps]
        return {
            "mode": self.mode,
            "concurrency": self.concurrency,
            "ok": len(self.ok),
            "failed": len(self.requests) - len(self.ok),
            "tokens": self.tokens,
            "wall_s": self.wall_s,
            "tok_s": self.tok_s,
            "ttft_p50_ms": 1000 * percentile(ttfts, 50),
            "ttft_p95_ms": 1000 * percentile(ttfts, 95),
            "ttft_p99_ms": 1000 * percentile(ttfts, 99),
            "itl_p50_ms": 1000 * percentile(gaps, 50),
            "itl_p95_ms": 1000 * percentile(gaps, 95),
            "errors": sorted({r.error for r in self.requests if r.error}),
        }


# ---- server mode (HTTP, trio + httpx) ---------------------------------------------------


def _chat_body(prompt: str, max_tokens: int, extra: dict | None = None) -> dict:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": max_tokens,
        **(extra or {}),
    }


def _on_event(result: RequestResult, event: dict, t0: float, last: list[float]) -> None:
    """Record one SSE JSON event: content timing, usage, or an error event."""
    if "error" in event:
        result.error = str(event["error"].get("message", event["error"]))
        return
    if event.get("usage"):
        result.tokens = event["usage"]["completion_tokens"]
    for choice in event.get("choices", ()):
        if not (choice.get("delta") or {}).get("content"):
            continue
        now = time.perf_counter()
        if result.ttft is None:
            result.ttft = now - t0
        else:
            result.gaps.append(now - last[0])
        last[0] = now


async def _read_stream(response, result: RequestResult, t0: float) -> None:
    last = [t0]
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        _on_event(result, json.loads(data), t0, last)


async def stream_one(
    client, url: str, prompt: str, max_tokens: int, extra: dict | None = None
) -> RequestResult:
    """One streaming chat request; HTTP and protocol failures become ``error``."""
    import httpx

    result = RequestResult()
    t0 = time.perf_counter()
    try:
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=_chat_body(prompt, max_tokens, extra)
        ) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:200]}"
            else:
                await _read_stream(response, result, t0)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e = time.perf_counter() - t0
    if result.error is None and result.tokens == 0:
        result.error = "no usage chunk in the stream"
    return result


async def _server_level(
    client, url: str, concurrency: int, max_tokens: int, extra: dict | None
) -> LevelResult:
    import trio

    results: list[RequestResult] = []

    async def one(prompt: str) -> None:
        results.append(await stream_one(client, url, prompt, max_tokens, extra))

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for prompt in prompts(concurrency):
            nursery.start_soon(one, prompt)
    return LevelResult("server", concurrency, time.perf_counter() - t0, results)


async def _server_all(
    url: str, levels: list[int], max_tokens: int, timeout_s: float, extra: dict | None
) -> list[LevelResult]:
    import httpx

    limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels))
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        warm = await stream_one(client, url, prompts(1)[0], max_tokens, extra)
        if warm.error:
            raise SystemExit(f"bench: warm-up request to {url} failed: {warm.error}")
        return [await _server_level(client, url, c, max_tokens, extra) for c in levels]


def run_server(
    url: str, levels: list[int], max_tokens: int, timeout: float, extra: dict | None = None
) -> list[LevelResult]:
    import trio

    return trio.run(_server_all, url.rstrip("/"), levels, max_tokens, timeout, extra)


# ---- engine mode (in-process, no HTTP) --------------------------------------------------


def _tokenized(tokenizer, concurrency: int, max_tokens: int, tag: str) -> list:
    from mlxd.protocol.messages import SamplingParams, TokenizedRequest

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    out = []
    for i, prompt in enumerate(prompts(concurrency)):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        tokens = tuple(tokenizer.encode(text, add_special_tokens=False))
        out.append(TokenizedRequest(request_id=f"{tag}-{i}", prompt_tokens=tokens, sampling=params))
    return out


def _record_step(step, results: dict[str, RequestResult], last: dict[str, float], t0: float):
    now = time.perf_counter()
    for ts in step.tokens:
        result = results[ts.request_id]
        result.tokens += len(ts.tokens)
        if ts.tokens and result.ttft is None:
            result.ttft = now - t0
        elif ts.tokens:
            result.gaps.append(now - last[ts.request_id])
        if ts.tokens:
            last[ts.request_id] = now
        if ts.finish_reason is not None:
            result.e2e = now - t0
    for failed in step.failed:
        results[failed.request_id].error = failed.message


def _engine_level(core, requests: list, mode: str = "engine") -> LevelResult:
    """Submit every request at once, step until idle; TTFT is submit → first-token step."""
    results = {r.request_id: RequestResult() for r in requests}
    last: dict[str, float] = {}
    t0 = time.perf_counter()
    for request in requests:
        core.submit(request)
    while not core.idle:
        _record_step(core.step(), results, last, t0)
    return LevelResult(mode, len(requests), time.perf_counter() - t0, list(results.values()))


def run_engine(levels: list[int], max_tokens: int, config: Path | None) -> list[LevelResult]:
    """The engine as ``serve`` builds it from the same settings (``load_options`` and
    ``engine_options``: every loader, feature and engine option), without HTTP."""
    from mlxd.actors.engine.actor import core_for
    from mlxd.actors.engine.loading.load import load_served
    from mlxd.daemon import blas
    from mlxd.daemon.settings import load_settings
    from mlxd.daemon.supervisor import engine_options, load_options

    settings = load_settings(config)
    blas.set_threads(settings.engine.blas_threads)
    runner, info = load_served(load_options(settings))
    entry = settings.model_entries()[0]
    core = core_for(runner, info, entry.max_batch, engine_options(settings, None))
    _engine_level(core, _tokenized(info.tokenizer, 1, max_tokens, "warmup"))
    return [_engine_level(core, _tokenized(info.tokenizer, c, max_tokens, f"c{c}")) for c in levels]


# ---- report -------------------------------------------------------------------------------

# (header, summary key, width, format type); the first column is left-aligned.
_COLUMNS = (
    ("mode", "mode", 7, "s"),
    ("C", "concurrency", 4, "d"),
    ("ok", "ok", 4, "d"),
    ("failed", "failed", 6, "d"),
    ("tokens", "tokens", 7, "d"),
    ("wall_s", "wall_s", 8, ".2f"),
    ("tok/s", "tok_s", 8, ".1f"),
    ("ttft_p50ms", "ttft_p50_ms", 10, ".0f"),
    ("ttft_p95ms", "ttft_p95_ms", 10, ".0f"),
    ("ttft_p99ms", "ttft_p99_ms", 10, ".0f"),
    ("itl_p50ms", "itl_p50_ms", 9, ".1f"),
    ("itl_p95ms", "itl_p95_ms", 9, ".1f"),
)


def _header() -> str:
    cells = [f"{h:{'<' if i == 0 else '>'}{w}}" for i, (h, _, w, _) in enumerate(_COLUMNS)]
    return "  ".join(cells)


def _row(summary: dict) -> str:
    cells = [
        f"{summary[key]:{'<' if i == 0 else '>'}{w}{t}}"
        for i, (_, key, w, t) in enumerate(_COLUMNS)
    ]
    return "  ".join(cells)


def ratios(results: list[LevelResult]) -> dict[int, float]:
    """server tok/s ÷ engine tok/s for each concurrency measured in both modes."""
    engine = {r.concurrency: r.tok_s for r in results if r.mode == "engine"}
    server = {r.concurrency: r.tok_s for r in results if r.mode == "server"}
    return {c: server[c] / engine[c] for c in engine if c in server and engine[c] > 0}


def report(results: list[LevelResult]) -> str:
    lines = [_header()] + [_row(r.summary()) for r in results]
    for c, ratio in ratios(results).items():
        lines.append(f"C={c}: server/engine tok/s = {ratio:.2f}")
    for r in results:
        for error in r.summary()["errors"]:
            lines.append(f"{r.mode} C={r.concurrency} error: {error}")
    return "\n".join(lines)


def as_json(results: list[LevelResult]) -> str:
    return json.dumps(
        {
            "results": [r.summary() for r in results],
            "ratios": {str(c): v for c, v in ratios(results).items()},
            "requests": [
                {
                    "mode": r.mode,
                    "concurrency": r.concurrency,
                    "each": [asdict(x) for x in r.requests],
                }
                for r in results
            ],
        },
        indent=2,
    )


# ---- command line ---------------------------------------------------------------------------


def _levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from exc
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive integers")
    return levels


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlxd bench",
        description=__doc__.splitlines()[0],
        epilog="docs: docs/development.md#benchmarks",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--engine", action="store_true", help="in-process engine only, no HTTP")
    mode.add_argument("--both", action="store_true", help="engine, then the server at --url")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--concurrency", type=_levels, default=[1, 8, 32], help="e.g. 1,8,32")
    p.add_argument("--max-tokens", type=int, default=128, help="completion tokens per request")
    p.add_argument("--timeout", type=float, default=600.0, help="HTTP timeout, seconds")
    p.add_argument("--config", type=Path, help="TOML settings for engine mode")
    p.add_argument("--json", action="store_true", help="print machine-readable results")
    p.add_argument(
        "--body",
        type=json.loads,
        default=None,
        help='extra chat request fields as JSON, e.g. \'{"logprobs": true, "top_logprobs": 5}\'',
    )
    return p


def main(argv: list[str] | None = None, record: Callable[..., None] | None = None) -> int:
    """``record(results, both, argv)``, when given, keeps the run (``scripts/bench.py``
    writes it to docs/results; the daemon's layer imports no scripts)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # ``mlxd bench -- --engine``: argparse's REMAINDER keeps the separator.
    args = _parser().parse_args(argv[1:] if argv[:1] == ["--"] else argv)
    results: list[LevelResult] = []
    if args.engine or args.both:
        results += run_engine(args.concurrency, args.max_tokens, args.config)
    if not args.engine:
        results += run_server(args.url, args.concurrency, args.max_tokens, args.timeout, args.body)
    print(as_json(results) if args.json else report(results))
    if record is not None:
        record(results, args.both, argv)
    failed = sum(len(r.requests) - len(r.ok) for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
