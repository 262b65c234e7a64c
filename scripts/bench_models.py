"""Model switch latency: two models in one daemon, loaded on first use, one at a time.

Serves SmolLM2-135M-Instruct (the bundled GGUF) and a second model (``--second``:
``hybrid``, a random-weight Qwen3.5 hybrid of about SmolLM2's compute, or ``tiny``, a
4-layer llama, or a model directory) as two ``[[models]]`` entries with
``model_pool.max_loaded = 1``, so each request to the other model unloads one and loads
the other. Runs the actor graph in-process (no HTTP) and prints, per round, each
model's load and unload time (as the engine measured them), the first request's
latency after the switch and a warm request's. ``--concurrent N`` instead loads both
and sends N long requests to each at once: each model's tokens per second while they
share the generation thread (round-robin), and each alone. A number printer, not a test:
``python -m mlxd.scripts.bench_models`` (OpenBLAS preloaded on Linux, e.g.
``LD_PRELOAD``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import trio
from mlxd.daemon.settings import load_settings
from mlxd.daemon.supervisor import open_graph, run_actors
from mlxd.protocol.messages import (
    ChatRequest,
    Failed,
    Finished,
    Message,
    SamplingParams,
    TextDelta,
)


def second_model(name: str, tmp: Path) -> tuple[str, str]:
    """The second model's path and a line describing it."""
    from mlxd.scripts.bench_agents import converted, prepare
    from mlxd.scripts.tiny_models import LLAMA, build_text_model

    if name == "hybrid":
        path, label = prepare("hybrid", tmp)
        return str(path), label
    if name == "tiny":
        return str(build_text_model(LLAMA, converted(), tmp / "tiny")), "tiny llama (4 layers)"
    return name, name


async def timed(
    pipeline, rid: str, model: str, max_tokens: int = 8, out=None
) -> tuple[float, float]:
    """(seconds to the first token, seconds to the end) of a greedy request; its completion
    tokens are added to ``out[model]``."""
    request = ChatRequest(
        request_id=rid,
        model=model,
        messages=(Message(role="user", content="Say hello."),),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )
    start, first = time.perf_counter(), None
    async for batch in (await pipeline.submit(request)).events():
        for event in batch:
            if isinstance(event, Failed):
                raise RuntimeError(f"{model}: {event.message}")
            if isinstance(event, TextDelta) and first is None:
                first = time.perf_counter() - start
            if isinstance(event, Finished) and out is not None:
                out[model] = out.get(model, 0) + event.completion_tokens
    end = time.perf_counter() - start
    return first if first is not None else end, end


async def run(second: str, rounds: int) -> list[dict]:
    raw = msgspec.to_builtins(load_settings())
    raw["models"] = [{"id": "smollm", "path": ""}, {"id": "second", "path": second}]
    raw["model_pool"]["max_loaded"] = 1
    settings = msgspec.convert(raw, type=type(load_settings()))
    graph = open_graph(settings)
    pipeline = graph.pipeline
    rows = []
    async with trio.open_nursery() as nursery:
        await nursery.start(run_actors, graph, settings, None)
        for i in range(rounds):
            for model, other in (("smollm", "second"), ("second", "smollm")):
                cold = await timed(pipeline, f"{model}-{i}-cold", model)
                warm = await timed(pipeline, f"{model}-{i}-warm", model)
                entries = pipeline.models.entries
                rows.append(
                    {
                        "round": i,
                        "model": model,
                        "load_s": entries[model].last_load_s,
                        "unloaded": other if entries[other].unloads else "-",
                        "unload_s": entries[other].last_unload_s if entries[other].unloads else 0,
                        "first_ttft_s": cold[0],
                        "first_request_s": cold[1],
                        "warm_ttft_s": warm[0],
                        "warm_request_s": warm[1],
                        "weights_mib": entries[model].weights_bytes / 2**20,
                    }
                )
        nursery.cancel_scope.cancel()
    return rows


async def concurrent(second: str, n: int, tokens: int = 64) -> None:
    """Both models loaded; ``n`` requests of ``tokens`` tokens to each, alone then together."""
    raw = msgspec.to_builtins(load_settings())
    raw["models"] = [{"id": "smollm", "path": ""}, {"id": "second", "path": second}]
    raw["prefix_cache"]["enabled"] = False
    settings = msgspec.convert(raw, type=type(load_settings()))
    graph = open_graph(settings)
    done: dict[str, float] = {}
    made: dict[str, dict[str, int]] = {"alone": {}, "both": {}}

    async def burst(model: str, tag: str) -> None:
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(n):
                rid = f"{tag}-{model}-{i}"
                nursery.start_soon(timed, graph.pipeline, rid, model, tokens, made[tag])
        done[f"{tag}-{model}"] = time.perf_counter() - start

    async with trio.open_nursery() as nursery:
        await nursery.start(run_actors, graph, settings, None)
        for model in ("smollm", "second"):  # load both, warm up
            await timed(graph.pipeline, f"warm-{model}", model)
        for model in ("smollm", "second"):
            await burst(model, "alone")
        before = {m: graph.pipeline.stats_of(m).decode_steps for m in ("smollm", "second")}
        async with trio.open_nursery() as both:
            for model in ("smollm", "second"):
                both.start_soon(burst, model, "both")
        steps = {m: graph.pipeline.stats_of(m).decode_steps - before[m] for m in before}
        nursery.cancel_scope.cancel()
    print(f"{n} concurrent requests of at most {tokens} tokens per model")
    for model in ("smollm", "second"):
        alone, both = done[f"alone-{model}"], done[f"both-{model}"]
        a, b = made["alone"][model], made["both"][model]
        print(
            f"{model:>7}: alone {a} tokens in {alone:6.2f}s ({a / alone:5.1f} tok/s); "
            f"both models at once {b} tokens in {both:6.2f}s ({b / both:5.1f} tok/s, "
            f"{steps[model]} decode steps)"
        )


def report(rows: list[dict], label: str) -> None:
    print(f"second model: {label}; model_pool.max_loaded = 1 (every switch unloads the other)")
    print(
        f"{'round':>5} {'model':>7} {'load s':>7} {'unloaded':>9} {'unload s':>9} "
        f"{'1st TTFT':>8} {'1st req s':>9} {'warm TTFT':>9} {'warm s':>7} {'weights MiB':>11}"
    )
    for r in rows:
        print(
            f"{r['round']:>5} {r['model']:>7} {r['load_s']:>7.2f} {r['unloaded']:>9} "
            f"{r['unload_s']:>9.3f} {r['first_ttft_s']:>8.2f} {r['first_request_s']:>9.2f} "
            f"{r['warm_ttft_s']:>9.2f} {r['warm_request_s']:>7.2f} "
            f"{r['weights_mib']:>11.0f}"
        )
    for model in ("smollm", "second"):
        later = [r for r in rows if r["model"] == model and r["round"] > 0] or rows
        loads = [r["load_s"] for r in later if r["model"] == model]
        if loads:
            print(f"{model}: median load {statistics.median(loads):.2f}s after the first round")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--second", default="hybrid", help="hybrid, tiny or a model directory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrent", type=int, default=0, help="N requests per model")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path, label = second_model(args.second, Path(tmp))
        if args.concurrent:
            print(f"second model: {label}")
            trio.run(concurrent, path, args.concurrent)
            return
        rows = trio.run(run, path, args.rounds)
    report(rows, label)
    sys.stdout.flush()
    from mlxd.scripts import records  # docs/benchmarks.md is rendered from the records

    figures = records.numbers({f"round {r['round']} {r['model']}": r for r in rows})
    command = records.command(argv, module="mlxd.scripts.bench_models")
    records.write("bench_models", command=command, figures=figures,
                  notes=f"second model: {label}; model_pool.max_loaded = 1")  # fmt: skip


if __name__ == "__main__":
    main()
