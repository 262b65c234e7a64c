"""Flood a running server: N concurrent streaming chat requests at once.

Prints how many got a full answer (200), how many were refused (429 queue
full, 503 queue timeout / overloaded) and anything else, whether ``/health``
stayed 200 throughout, and TTFT p50/p99 of the admitted requests. With
``--pid`` (the server's process) also its resident memory before the burst, at
its peak, and ``--settle`` seconds after it (MLX's freed buffers go back to the
system when the engine goes idle).

    python -m mlxd.scripts.flood --url http://127.0.0.1:8000 -n 200 --max-tokens 32 --pid PID
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

from mlxd.daemon.bench import percentile, prompts


async def _one(client, url: str, prompt: str, max_tokens: int) -> tuple[int, float | None, str]:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    t0, ttft, finish = time.perf_counter(), None, ""
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                finish = "error"
                continue
            choice = (event.get("choices") or [{}])[0]
            if ttft is None and (choice.get("delta") or {}).get("content"):
                ttft = time.perf_counter() - t0
            finish = choice.get("finish_reason") or finish
        return r.status_code, ttft, finish


def rss_mb(pid: int | None) -> float:
    """Resident memory of process ``pid`` in MiB (Linux /proc); 0 without a pid."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/status") as f:
        line = next(ln for ln in f if ln.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


async def flood(
    url: str, n: int, max_tokens: int, pid: int | None = None, settle_s: float = 3.0
) -> dict:
    import httpx
    import trio

    results: list[tuple[int, float | None, str]] = []
    health: list[int] = []
    rss = [rss_mb(pid)]
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(prompt: str) -> None:
            results.append(await _one(client, url, prompt, max_tokens))

        async def watch(done: trio.Event) -> None:
            while not done.is_set():
                health.append((await client.get(f"{url}/health")).status_code)
                rss.append(rss_mb(pid))
                await trio.sleep(0.25)

        done = trio.Event()
        t0 = time.perf_counter()
        async with trio.open_nursery() as outer:
            outer.start_soon(watch, done)
            async with trio.open_nursery() as nursery:
                for prompt in prompts(n):
                    nursery.start_soon(one, prompt)
            done.set()
        wall = time.perf_counter() - t0
        health.append((await client.get(f"{url}/health")).status_code)
        await trio.sleep(settle_s if pid else 0)
    ttfts = [t for status, t, _ in results if status == 200 and t is not None]
    return {
        "requests": n,
        "wall_s": round(wall, 2),
        "status": dict(Counter(status for status, _, _ in results)),
        "finish": dict(Counter(f for status, _, f in results if status == 200)),
        "health": dict(Counter(health)),
        "ttft_p50_ms": round(1000 * percentile(ttfts, 50)),
        "ttft_p99_ms": round(1000 * percentile(ttfts, 99)),
        **(
            {"rss_before_mb": round(rss[0]), "rss_peak_mb": round(max(rss))}
            | {"rss_after_mb": round(rss_mb(pid))}
            if pid
            else {}
        ),
    }


def main(argv: list[str] | None = None) -> int:
    import trio

    parser = argparse.ArgumentParser(prog="flood", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("-n", type=int, default=200, help="concurrent requests")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--pid", type=int, help="the server's process id: report its memory")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds before the last reading")
    args = parser.parse_args(argv)
    url = args.url.rstrip("/")
    result = trio.run(flood, url, args.n, args.max_tokens, args.pid, args.settle)
    print(json.dumps(result, indent=2))
    from mlxd.scripts import records  # docs/benchmarks.md is rendered from the records

    command = records.command(argv, module="mlxd.scripts.flood")
    records.write("flood", command=command, figures=records.numbers(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
