"""Short chats: mlxd against ``mlx_lm.server`` on the same model, in one run.

C concurrent short streaming chats (the prompts of ``mlxd bench``, about 60 tokens
each, opening with a tag of their own so that no cell finds another's in a prompt
cache), greedy, ``max_tokens`` each, sent with ``mlxd bench``'s client to each
server in turn (each server answers one warm-up chat first): every server is started as a subprocess on a free loopback port
(``bench_agents.serving``), given every (max_tokens, concurrency) cell and stopped,
then the next. Rounds alternate the order of the servers, so a neighbour's load on a
shared machine falls on both. Prints per round and cell each server's tok/s and TTFT
p50, the ratio mlxd / mlx_lm.server (above 1: mlxd is faster) and the load average
around each server's turn, then the median ratio over the rounds.

    python -m mlxd.scripts.bench_chat                             # 8 and 32, 64 and 128 tokens
    python -m mlxd.scripts.bench_chat --rounds 3 --concurrency 8 --max-tokens 64
    python -m mlxd.scripts.bench_chat --mlxd old=old.toml          # another mlxd config too

``--mlxd NAME=FILE`` adds an mlxd run with that settings file (repeatable); the plain
``mlxd`` run uses the defaults. The model is SmolLM2-135M-Instruct, dequantized to
float32 on the CPU backend, unless ``--model`` names a directory or .gguf file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio
from mlxd.daemon import bench
from mlxd.scripts import bench_agents


@dataclass(frozen=True)
class Server:
    """One contestant: ``kind`` is mlxd or mlx_lm, ``config`` an mlxd settings file."""

    name: str
    kind: str
    config: Path | None = None


@dataclass
class Turn:
    """One server's pass over every cell in one round."""

    server: str
    round: int
    load_before: float
    load_after: float = 0.0
    cells: dict[str, dict] = field(default_factory=dict)  # "C=8 max=64" → summary


def cell(concurrency: int, max_tokens: int) -> str:
    return f"C={concurrency} max={max_tokens}"


def run_server(server: Server, model_dir: Path, args, round_: int, logs: Path) -> Turn:
    turn = Turn(server.name, round_, os.getloadavg()[0])
    log = logs / f"{server.name}-{round_}.log"
    with bench_agents.serving(server.kind, model_dir, log, args.ready_timeout, server.config) as (
        url,
        _,
    ):
        for max_tokens in args.max_tokens:
            for c in args.concurrency:
                tag = f"{round_}.{max_tokens}.{c}"
                summary = trio.run(chats, url, chat_prompts(c, tag), max_tokens, args.timeout)
                turn.cells[cell(c, max_tokens)] = summary
    turn.load_after = os.getloadavg()[0]
    return turn


def chat_prompts(n: int, tag: str) -> list[str]:
    """``mlxd bench``'s prompts, each opening with its own tag: no cell reuses another's
    prompts from either server's prompt cache (the same tags for every server)."""
    return [f"[chat {tag}.{i}] {p}" for i, p in enumerate(bench.prompts(n))]


async def chats(url: str, prompts: list[str], max_tokens: int, timeout_s: float):
    """All ``prompts`` at once as streaming greedy chats (``mlxd bench``'s client)."""
    import httpx

    results: list[bench.RequestResult] = []
    retried = [0]

    async def one(prompt: str) -> None:
        for _ in range(_RETRIES):  # a refused connection (a small listen backlog) retries
            result = await bench.stream_one(client, url, prompt, max_tokens)
            if result.ttft is not None or not _refused(result.error):
                break
            retried[0] += 1
            await trio.sleep(0.05)
        results.append(result)

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(one, prompt)
        wall = time.perf_counter() - t0
    level = bench.LevelResult("server", len(prompts), wall, results)
    return {**level.summary(), "retried": retried[0]}


# mlx_lm.server's HTTP server (the standard library's) accepts 5 pending connections: at
# 32 clients some are refused or reset before a byte comes back. They are sent again.
_RETRIES = 20


def _refused(error: str | None) -> bool:
    """A transport error before any token (not an HTTP status, not a broken stream)."""
    return error is not None and not error.startswith(("HTTP ", "no usage", "JSONDecodeError"))


def ratios(turns: list[Turn], name: str, base: str = "mlx_lm") -> dict[str, list[float]]:
    """Per cell, ``name``'s tok/s over ``base``'s, one ratio per round."""
    out: dict[str, list[float]] = {}
    for r in sorted({t.round for t in turns}):
        mine = next(t for t in turns if t.round == r and t.server == name)
        theirs = next(t for t in turns if t.round == r and t.server == base)
        for key, summary in mine.cells.items():
            out.setdefault(key, []).append(summary["tok_s"] / theirs.cells[key]["tok_s"])
    return out


def report(turns: list[Turn], servers: list[Server]) -> str:
    lines = []
    for t in turns:
        lines.append(
            f"round {t.round} {t.server:>10}: load {t.load_before:.2f} -> {t.load_after:.2f}  "
            + "  ".join(
                f"{k}: {s['tok_s']:5.1f} tok/s ttft50 {s['ttft_p50_ms']:5.0f} ms"
                + (f" (resent {s['retried']})" if s["retried"] else "")
                + (f" FAILED {s['failed']}: {s['errors'][:2]}" if s["failed"] else "")
                for k, s in t.cells.items()
            )
        )
    for s in servers:
        if s.kind != "mlxd":
            continue
        for key, values in ratios(turns, s.name).items():
            each = ", ".join(f"{v:.2f}" for v in values)
            lines.append(
                f"{s.name} / mlx_lm.server {key}: median {statistics.median(values):.2f} ({each})"
            )
    return "\n".join(lines)


def _server(text: str) -> Server:
    name, eq, path = text.partition("=")
    if not (eq and name and path):
        raise argparse.ArgumentTypeError(f"expected NAME=FILE, got {text!r}")
    return Server(name, "mlxd", Path(path).resolve())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="default (SmolLM2), a dir or a .gguf")
    p.add_argument("--concurrency", type=bench._levels, default=[8, 32])
    p.add_argument("--max-tokens", type=bench._levels, default=[64, 128])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--mlxd", type=_server, action="append", default=[], help="NAME=FILE")
    p.add_argument("--no-default", action="store_true", help="no mlxd run with the defaults")
    p.add_argument("--timeout", type=float, default=900.0, help="HTTP timeout, seconds")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    servers = [] if args.no_default else [Server("mlxd", "mlxd")]
    servers += [*args.mlxd, Server("mlx_lm", "mlx_lm")]
    turns: list[Turn] = []
    with tempfile.TemporaryDirectory(prefix="mlxd-bench-chat-") as tmp:
        model_dir, label = bench_agents.prepare(args.model, Path(tmp))
        print(f"model: {label}; {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
        for r in range(args.rounds):
            order = servers if r % 2 == 0 else servers[::-1]
            for server in order:
                turns.append(run_server(server, model_dir, args, r, Path(tmp)))
                print(report(turns[-1:], []), flush=True)
    print(report(turns, servers))
    if args.json:
        print(json.dumps([t.__dict__ for t in turns], indent=1))
    _record(turns, servers, argv)
    return 1 if any(s["failed"] for t in turns for s in t.cells.values()) else 0


def _record(turns: list[Turn], servers: list[Server], argv: list[str] | None) -> None:
    """The run as a record in docs/results: each mlxd's median tok/s ratio per cell."""
    from mlxd.scripts import records

    rows = [
        records.compared(
            f"{s.name}: {cell}", "tok/s", better="higher", ratio=statistics.median(values)
        )  # fmt: skip
        for s in servers
        if s.kind == "mlxd"
        for cell, values in ratios(turns, s.name).items()
    ]
    figures = {
        f"round {t.round} {t.server} {cell} {key}": s[key]
        for t in turns
        for cell, s in t.cells.items()
        for key in ("tok_s", "ttft_p50_ms")
    }
    command = records.command(argv, module="mlxd.scripts.bench_chat")
    records.write("bench_chat", command=command, peer="mlx_lm.server", rows=rows, figures=figures)


if __name__ == "__main__":
    sys.exit(main())
