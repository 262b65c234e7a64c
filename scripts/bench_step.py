"""What an engine step costs: mlxd's engine against mlx-lm's own ``BatchGenerator``.

Decode: B sequences with a C-token context each are prefilled (untimed), then N decode
steps are timed three ways on the same loaded model: mlx-lm's ``BatchGenerator.next()``
alone (what ``mlx_lm.server`` runs), mlxd's ``EngineCore.step()`` over its runner (the
same generator underneath, plus mlxd's scheduling, guards and bookkeeping), and the bare
model forward on a merged batch cache with greedy argmax (the floor). The difference
between the first two is what mlxd adds per step.

Prefill: K requests each add S new tokens to a C-token context they already hold (the
agent case: a new tool output on top of a cached conversation); timed one request at a
time on one stream, one request at a time with each chunk split across MLX streams
(``engine.prefill_streams``), and with mlxd's batched prefill (all K chunks in one
forward pass, one stream).

Host overhead (``--tiny``): the same decode comparison on a model with almost no compute
(one llama layer, hidden size 64, a 512-token vocabulary, random weights, token ids
only), at batch 1, 8 and 32, so what remains is each side's host work per step. The
target is mlxd/mlx_lm <= 1.05.

Prints numbers; asserts nothing. Run from the repository root:

    .venv/bin/python -m mlxd.scripts.bench_step [--model DIR] [--batch 1,4,8]
        [--context 128,1536,3072] [--steps 16] [--prefill-requests 4] [--prefill-tokens 256]
        [--prefill-streams 2] [--blas-threads 0]
    .venv/bin/python -m mlxd.scripts.bench_step --tiny [--steps 200] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mlxd.daemon import blas


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _prompts(batch: int, context: int, salt: int = 0, vocab: int = 31000) -> list[list[int]]:
    # distinct token ranges per row: no prefix-cache sharing between rows
    low = min(1000, vocab // 4)
    return [
        [low + (salt * 7919 + i * 613 + t) % (vocab - low) for t in range(context)]
        for i in range(batch)
    ]


TINY_VOCAB = 512


def tiny_runner():
    """An ``MlxRunner`` over a one-layer llama of hidden size 64 (random weights, built as
    ``tiny_models.py`` builds its models, no tokenizer, no stop token): almost no compute."""
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlxd.actors.engine.runner.base import MlxRunner
    from mlxd.scripts.tiny_models import LLAMA

    config = {**LLAMA, "num_hidden_layers": 1, "hidden_size": 64, "vocab_size": TINY_VOCAB}
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return MlxRunner(model, [], 64)


def _request(rid: str, tokens, max_tokens: int):
    from mlxd.protocol.messages import SamplingParams, TokenizedRequest

    return TokenizedRequest(
        request_id=rid,
        prompt_tokens=tuple(tokens),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


def time_generator(model, prompts, steps: int) -> float:
    """Seconds per ``BatchGenerator.next()`` once every row decodes."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=64, prefill_batch_size=64)
    gen.insert(prompts, max_tokens=[steps + 8] * len(prompts))
    while len(gen.next()[1]) < len(prompts):  # prefill, then the first token of each
        pass
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        gen.next()
    dt = (time.perf_counter() - t0) / steps
    gen.close()
    return dt


def time_engine(runner, prompts, steps: int, salt: str) -> float:
    """Seconds per ``EngineCore.step()`` once every row decodes."""
    from mlxd.actors.engine.scheduler.core import EngineCore

    core = EngineCore(runner, max_batch=64, prefill_chunk_tokens=4096)
    for i, p in enumerate(prompts):
        core.submit(_request(f"{salt}{i}", p, steps + 8))
    while len(core.decoding) < len(prompts):
        core.step()
    core.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    dt = (time.perf_counter() - t0) / steps
    while not core.idle:
        core.step()
    return dt


def time_forward(model, prompts, steps: int) -> float:
    """Seconds per bare batched forward + argmax: the floor under both."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = []
    for p in prompts:
        cache = make_prompt_cache(model)
        model(mx.array([p]), cache=cache)
        mx.eval([c.state for c in cache])
        caches.append(cache)
    batch = [layer.merge([c[i] for c in caches]) for i, layer in enumerate(caches[0])]
    y = mx.array([[p[-1]] for p in prompts])
    mx.eval(model(y, cache=batch))
    t0 = time.perf_counter()
    for _ in range(steps):
        y = mx.argmax(model(y, cache=batch)[:, -1:], axis=-1)
        mx.eval(y)
    return (time.perf_counter() - t0) / steps


def time_prefill(runner, k: int, context: int, new: int, batched: bool, salt: str) -> float:
    """Seconds to prefill ``new`` tokens for each of ``k`` requests over a cached context."""
    from mlxd.actors.engine.scheduler.core import EngineCore

    core = EngineCore(runner, max_batch=64, prefill_chunk_tokens=k * new, batch_prefill=batched)
    bases = _prompts(k, context, salt=context)  # both runs prefill the same rows
    for i, base in enumerate(bases):  # warm the prefix cache with each context
        core.submit(_request(f"{salt}w{i}", base + [5], 1))
    while not core.idle:
        core.step()
    extended = [base + [7 + (t % 50) for t in range(new)] + [5] for base in bases]
    for i, p in enumerate(extended):
        core.submit(_request(f"{salt}p{i}", p, 1))
    t0 = time.perf_counter()
    while not core.idle:
        core.step()
    return time.perf_counter() - t0


def decode_table(runner, args) -> list[dict]:
    """Decode-step rows: BatchGenerator, mlxd's engine and the bare forward, per context
    and batch size; printed as they come."""
    rows = []
    for context in args.context:
        for batch in args.batch:
            prompts = _prompts(batch, context, salt=context + batch, vocab=args.vocab)
            runner.clear_cache()
            # best of ``--repeat`` runs of each, interleaved (a shared machine's noise)
            gen, eng, fwd = [], [], []
            for r in range(args.repeat):
                gen.append(time_generator(runner.model, prompts, args.steps))
                eng.append(time_engine(runner, prompts, args.steps, f"d{context}x{batch}r{r}"))
                fwd.append(time_forward(runner.model, prompts, args.steps))
            row = {
                "context": context,
                "batch": batch,
                "mlx_lm_ms": 1000 * min(gen),
                "mlxd_ms": 1000 * min(eng),
                "forward_ms": 1000 * min(fwd),
            }
            row["mlxd_over_mlx_lm"] = row["mlxd_ms"] / row["mlx_lm_ms"]
            rows.append(row)
            print(
                f"decode  C={context:5d} B={batch:3d}: BatchGenerator {row['mlx_lm_ms']:7.1f} ms/step"
                f"  mlxd engine {row['mlxd_ms']:7.1f}  bare forward {row['forward_ms']:7.1f}"
                f"  mlxd/mlx_lm {row['mlxd_over_mlx_lm']:.3f}",
                flush=True,
            )
    return rows


def prefill_table(runner, args) -> list[dict]:
    """Prefill rows: one at a time, split over streams, batched, per context; printed."""
    rows = []
    k, new = args.prefill_requests, args.prefill_tokens
    for context in args.context if k else []:
        runner.clear_cache()
        runner.use_prefill_streams(1)
        one = time_prefill(runner, k, context, new, False, f"o{context}")
        runner.clear_cache()
        runner.use_prefill_streams(args.prefill_streams)
        split = time_prefill(runner, k, context, new, False, f"s{context}")
        runner.clear_cache()
        runner.use_prefill_streams(1)
        both = time_prefill(runner, k, context, new, True, f"b{context}")
        rows.append(
            {
                "prefill_context": context,
                "k": k,
                "new": new,
                "alone_s": one,
                "split_s": split,
                "batched_s": both,
            }
        )
        print(
            f"prefill C={context:5d}: {k} x {new} new tokens: one at a time {one:6.2f} s"
            f" ({k * new / one:5.0f} tok/s); each chunk on {args.prefill_streams} streams"
            f" {split:6.2f} s ({k * new / split:5.0f} tok/s, x{one / split:.2f});"
            f" batched {both:6.2f} s ({k * new / both:5.0f} tok/s, x{one / both:.2f})",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="model dir or .gguf (default: SmolLM2)")
    p.add_argument("--batch", type=_ints, default=[1, 4, 8])
    p.add_argument("--context", type=_ints, default=[128, 1536, 3072])
    p.add_argument("--steps", type=int, default=0, help="decode steps timed (0: 16; 200 tiny)")
    p.add_argument("--prefill-requests", type=int, default=4)
    p.add_argument("--prefill-tokens", type=int, default=256)
    p.add_argument("--prefill-streams", type=int, default=2, help="streams of the split run")
    p.add_argument("--blas-threads", type=int, default=0, help="OpenBLAS threads (0: default)")
    p.add_argument("--tiny", action="store_true", help="host overhead: a model of ~no compute")
    p.add_argument("--repeat", type=int, default=0, help="runs per row, best kept (0: 1; 5 tiny)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    threads = blas.set_threads(args.blas_threads)
    args.vocab = 31000
    args.repeat = args.repeat or (5 if args.tiny else 1)
    args.steps = args.steps or (200 if args.tiny else 16)
    if args.tiny:
        tiny(args, threads)
        return

    from mlxd.actors.engine.loading.load import load_runner
    from mlxd.actors.engine.scheduler.options import PrefixCacheOptions

    cache_dir = Path("~/.cache/mlxd").expanduser()
    options = PrefixCacheOptions(block_size=64, max_bytes=4 << 30)
    runner, info = load_runner(
        args.model, cache_dir, dequantize_on_cpu=True, max_batch=64, prefix_cache=options
    )
    print(f"model {info.model_id} ({info.backend}); {blas.status()}; {threads}", flush=True)
    rows = decode_table(runner, args) + prefill_table(runner, args)
    if args.json:
        print(json.dumps(rows))
    _record("bench_step", rows, argv)


def tiny(args, threads: str) -> None:
    """``--tiny``: decode rows only, at batch 1, 8 and 32 over a 16-token context (unless
    ``--batch`` / ``--context`` say otherwise)."""
    import mlx.core as mx

    args.vocab = TINY_VOCAB
    if args.batch == [1, 4, 8]:
        args.batch = [1, 8, 32]
    if args.context == [128, 1536, 3072]:
        args.context = [16]
    runner = tiny_runner()
    print(f"tiny model (1 layer, hidden 64, {mx.default_device()}); {threads}", flush=True)
    rows = decode_table(runner, args)  # each row's first run warms its shapes up
    if args.json:
        print(json.dumps(rows))
    _record("bench_step_tiny", rows, None)


def _record(name: str, rows: list[dict], argv: list[str] | None) -> None:
    """The run as a record in docs/results: decode steps against BatchGenerator.next()."""
    from mlxd.scripts import records

    compared = [
        records.compared(f"context {r['context']}, batch {r['batch']}", "step time",
                         better="lower", unit="ms", mlxd=r["mlxd_ms"], peer=r["mlx_lm_ms"])
        for r in rows
        if "mlxd_ms" in r
    ]  # fmt: skip
    figures = records.numbers([r for r in rows if "mlxd_ms" not in r])
    command = records.command(argv, module="mlxd.scripts.bench_step")
    records.write(name, command=command, peer="mlx-lm's BatchGenerator.next()", rows=compared,
                  figures=figures)  # fmt: skip


if __name__ == "__main__":
    blas.reexec_with_openblas("mlxd.scripts.bench_step")
    main()
