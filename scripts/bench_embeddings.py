"""Embedding throughput (inputs/s) at batch 1, 8 and 32, on the tiny random embedding model.

Runs the actor graph in-process (no HTTP) with one ``kind = "embedding"`` model built by
``scripts/tiny_models.py`` and calls the embeddings core (``daemon/api/embeddings.embed``:
tokenization, the engine's batching, pooling) two ways per batch size N:

- ``one request``: requests of N inputs each, one after another;
- ``N clients``: N concurrent requests of one input each, which the engine batches
  together (``embeddings.max_batch_inputs``).

Each cell runs for ``--seconds``; the ratio is against batch 1 of the same run. A number
printer, not a test: ``python -m mlxd.scripts.bench_embeddings`` (OpenBLAS preloaded, e.g.
``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import msgspec
import trio
from mlxd.daemon.api.embeddings import EmbeddingLimits, embed
from mlxd.daemon.settings import load_settings
from mlxd.daemon.supervisor import open_graph, run_actors

WORDS = "the quick brown fox jumps over a lazy dog while models embed every sentence".split()
BATCHES = (1, 8, 32)


def texts(n: int, words: int, salt: int) -> list[str]:
    """``n`` distinct texts of about ``words`` words (lengths vary by a quarter)."""
    out = []
    for i in range(n):
        length = max(1, words - words // 4 + (i * 7 + salt) % (words // 2 + 1))
        out.append(" ".join(WORDS[(i + salt + j) % len(WORDS)] for j in range(length)))
    return out


async def run_for(seconds: float, job) -> float:
    """Inputs per second: ``job()`` (returning the inputs it embedded) again and again."""
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        done += await job()
    return done / (time.perf_counter() - start)


async def cells(pipeline, words: int, seconds: float) -> list[tuple[int, float, float]]:
    limits, salt = EmbeddingLimits(max_inputs=max(BATCHES)), 0
    await embed(pipeline, "embed", texts(4, words, 0), limits=limits)  # warm-up

    async def one_request(n: int) -> int:
        nonlocal salt
        salt += 1
        result = await embed(pipeline, "embed", texts(n, words, salt), limits=limits)
        return len(result.vectors)

    async def clients(n: int) -> int:
        nonlocal salt
        salt += 1
        async with trio.open_nursery() as nursery:
            for text in texts(n, words, salt):
                nursery.start_soon(lambda t=text: embed(pipeline, "embed", [t], limits=limits))
        return n

    rows = []
    for n in BATCHES:
        together = await run_for(seconds, lambda n=n: one_request(n))
        apart = await run_for(seconds, lambda n=n: clients(n))
        rows.append((n, together, apart))
    return rows


def settings_for(model_dir: Path, cache_dir: Path, max_batch_inputs: int):
    raw = msgspec.to_builtins(load_settings())
    raw["model"]["cache_dir"] = str(cache_dir)
    raw["models"] = [{"id": "embed", "path": str(model_dir), "kind": "embedding", "preload": True}]
    raw["embeddings"]["max_batch_inputs"] = max_batch_inputs
    return msgspec.convert(raw, type=type(load_settings()))


async def bench(model_dir: Path, cache_dir: Path, args) -> list[tuple[int, float, float]]:
    settings = settings_for(model_dir, cache_dir, max(BATCHES))
    graph = open_graph(settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(run_actors, graph, settings, None)
        rows = await cells(graph.pipeline, args.words, args.seconds)
        nursery.cancel_scope.cancel()
    base = rows[0][1]
    print(f"tiny embedding model (64 dims), ~{args.words}-word inputs, {args.seconds:g} s a cell")
    print(f"{'batch':>5}  {'one request':>18}  {'N clients':>18}")
    for n, together, apart in rows:
        print(
            f"{n:>5}  {together:>9.1f} in/s x{together / base:4.1f}"
            f"  {apart:>9.1f} in/s x{apart / base:4.1f}"
        )
    print(f"(ratios against batch 1, one request; load average {os.getloadavg()[0]:.2f})")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per cell")
    parser.add_argument("--words", type=int, default=24, help="about this many words an input")
    args = parser.parse_args()
    from mlxd.actors.engine.loading.gguf.convert import convert_gguf, default_model_path
    from mlxd.scripts.tiny_models import build_embedding_model

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokenizer = convert_gguf(default_model_path(), root / "gguf", lambda _: None)
        model = build_embedding_model(tokenizer, root / "embed")
        rows = trio.run(bench, model, root, args)
    from mlxd.scripts import records  # docs/benchmarks.md is rendered from the records

    figures = {}
    for n, together, apart in rows:
        figures[f"one request of {n} inputs (inputs/s)"] = together
        figures[f"{n} one-input clients (inputs/s)"] = apart
    command = records.command(module="mlxd.scripts.bench_embeddings")
    records.write("bench_embeddings", command=command, figures=figures)


if __name__ == "__main__":
    main()
