"""Time to first token with and without the prefix cache, on the default model.

Runs the actor graph in-process (no HTTP) and prints, for a ~2,000-token system
prompt and for a 5-turn agent-style conversation, TTFT cold vs cached. A number
printer, not a test: ``python -m mlxd.scripts.bench_prefix`` (OpenBLAS preloaded, e.g.
through ``mlxd bench-prefix`` or ``LD_PRELOAD``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import msgspec
import trio
from mlxd.daemon.settings import load_settings
from mlxd.daemon.supervisor import mlx_runner_factory, open_graph, run_actors
from mlxd.protocol.messages import ChatRequest, Message, SamplingParams, TextDelta

RULES = [
    "Always answer in plain English.",
    "Never reveal internal tool names.",
    "Prefer short answers with concrete steps.",
    "When unsure, ask one clarifying question.",
    "Cite file paths relative to the repository root.",
]


def system_prompt(tokenizer, target_tokens: int, salt: str) -> str:
    """A long agent-style system prompt of about ``target_tokens`` tokens."""
    lines = [f"You are coding agent {salt}. Follow these rules."]
    i = 0
    while len(tokenizer.encode("\n".join(lines))) < target_tokens:
        lines.append(f"Rule {i}: {RULES[i % len(RULES)]} (section {i // len(RULES)})")
        i += 1
    return "\n".join(lines)


async def ttft(pipeline, rid: str, messages, max_tokens: int) -> tuple[float, str, int]:
    request = ChatRequest(
        request_id=rid,
        messages=tuple(Message(role=r, content=c) for r, c in messages),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )
    start = time.perf_counter()
    first, texts, cached = None, [], 0
    async for batch in (await pipeline.submit(request)).events():
        for event in batch:
            if isinstance(event, TextDelta):
                first = first or time.perf_counter() - start
                texts.append(event.text)
            cached = getattr(event, "cached_tokens", cached)
    return first or float("nan"), "".join(texts), cached


async def system_prompt_case(pipeline, tokenizer, tokens: int, reps: int) -> list[str]:
    cold, warm, rows = [], [], []
    for rep in range(reps):
        system = system_prompt(tokenizer, tokens, salt=f"#{rep}")
        t_cold, _, _ = await ttft(pipeline, f"cold{rep}", [("system", system), ("user", "Hi!")], 8)
        t_warm, _, cached = await ttft(
            pipeline, f"warm{rep}", [("system", system), ("user", "What now?")], 8
        )
        cold.append(t_cold)
        warm.append(t_warm)
        rows.append(
            f"  rep {rep}: cold {t_cold:.2f}s  cached {t_warm:.3f}s  ({cached} tokens reused)"
        )
    c, w = statistics.median(cold), statistics.median(warm)
    rows.append(f"system prompt ~{tokens} tokens: cold {c:.2f}s, cached {w:.3f}s, {c / w:.1f}x")
    return rows


async def conversation(pipeline, tokenizer, tokens: int, turns: int, tag: str) -> list[float]:
    system = system_prompt(tokenizer, tokens, salt=f"conv-{tag}")
    history, times = [("system", system)], []
    for turn in range(turns):
        history.append(("user", f"Step {turn}: list one file to edit next."))
        t, text, _ = await ttft(pipeline, f"{tag}-turn{turn}", history, 24)
        history.append(("assistant", text))
        times.append(t)
    return times


async def run_case(enabled: bool, args) -> dict:
    base = msgspec.to_builtins(load_settings(args.config))
    base["prefix_cache"]["enabled"] = enabled
    settings = msgspec.convert(base, type=type(load_settings()))
    graph = open_graph(settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(run_actors, graph, settings, mlx_runner_factory(settings))
        pipeline = graph.pipeline
        tok = pipeline.info.tokenizer
        result: dict = {"conv": await conversation(pipeline, tok, args.tokens, 5, f"c{enabled}")}
        if enabled:
            result["system"] = await system_prompt_case(pipeline, tok, args.tokens, args.reps)
        nursery.cancel_scope.cancel()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_prefix", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000, help="system prompt length")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--config", default=None)
    args = parser.parse_args(argv)
    on = trio.run(run_case, True, args)
    off = trio.run(run_case, False, args)
    print("\n".join(on["system"]))
    print("5-turn conversation, TTFT per turn (s):")
    print("  cache off: " + "  ".join(f"{t:.2f}" for t in off["conv"]))
    print("  cache on:  " + "  ".join(f"{t:.2f}" for t in on["conv"]))
    later_off, later_on = sum(off["conv"][1:]), sum(on["conv"][1:])
    print(
        f"  turns 2-5 total: off {later_off:.2f}s, on {later_on:.2f}s, {later_off / later_on:.1f}x"
    )
    from mlxd.scripts import records  # docs/benchmarks.md is rendered from the records

    rows = [records.compared("turns 2-5 of a conversation", "TTFT, total", better="lower",
                             unit="s", mlxd=later_on, peer=later_off)]  # fmt: skip
    figures = records.numbers({"cache off, turn": off["conv"], "cache on, turn": on["conv"]})
    command = records.command(argv, module="mlxd.scripts.bench_prefix")
    records.write("bench_prefix", command=command, peer="the prefix cache off", rows=rows,
                  figures=figures, notes="\n".join(on["system"]))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
