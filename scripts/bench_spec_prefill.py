"""SpecPrefill time to first token vs a full prefill, at a few prompt lengths.

Loads the default model (or ``--model``) and drives the real runner in-process:
one request at a time, timed from ``start`` to its first decoded token (scoring,
sparse prefill and the first decode step included). The scorer is the model itself
unless ``--scorer`` names a smaller one: with the model scoring itself, scoring
(which needs the logits of every prompt token) costs about a full prefill, so
SpecPrefill only pays with a smaller scorer; the "prefill only" column shows the
target's part alone. Prints numbers; asserts nothing. From the repository root:

    .venv/bin/python -m mlxd.scripts.bench_spec_prefill [--scorer DIR] [--lengths 4096 8000]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from mlxd.daemon import blas

TEXT = (
    "The history of the river town is long and full of small events: markets, floods, "
    "weddings, quarrels over fishing rights and the slow arrival of the railway. "
)


def _request(tokenizer, length: int, tag: str):
    from mlxd.protocol.messages import SamplingParams, TokenizedRequest

    tokens = tokenizer.encode(TEXT * (length // 20 + 1))[: length - 8]
    tokens += tokenizer.encode(" In one sentence, what is this about?")[:8]
    return TokenizedRequest(
        request_id=tag,
        prompt_tokens=tuple(tokens),
        sampling=SamplingParams(max_tokens=1, temperature=0.0),
    )


def _ttft(runner, request, chunk: int) -> tuple[float, float]:
    """(seconds to the first token, seconds of which were scoring) for one request."""
    start = time.perf_counter()
    runner.start(request)
    pending = runner._pending[request.request_id]
    scored_at = start
    while runner.prefill(request.request_id, chunk):
        if pending.sparse is not None and pending.sparse.kept and scored_at == start:
            scored_at = time.perf_counter()
    runner.decode()
    end = time.perf_counter()
    while runner.decoding:
        runner.decode()
    return end - start, (scored_at - start)


def bench(args) -> list[dict]:
    from mlxd.actors.engine.loading.load import load_model, load_runner, make_spec_prefill
    from mlxd.actors.engine.runner.base import MlxRunner
    from mlxd.actors.engine.scheduler.options import SpecPrefillOptions

    cache_dir = Path(args.cache_dir).expanduser()
    plain, info = load_runner(args.model, cache_dir, dequantize_on_cpu=True, max_batch=8)
    scorer = (
        plain.model if not args.scorer else load_model(Path(args.scorer), dequantize_on_cpu=True)[0]
    )
    settings = SpecPrefillOptions(
        threshold_tokens=1, keep_fraction=args.keep, chunk_tokens=args.chunk_tokens
    )
    sp = make_spec_prefill(plain.model, (scorer, "scorer"), settings)
    stops = sorted(info.tokenizer.eos_token_ids)
    sparse = MlxRunner(plain.model, stops, 8, spec_prefill=sp)
    print(
        f"model {info.model_id} ({info.backend}), context {info.context_length}, scorer "
        f"{args.scorer or 'itself'}, keep {args.keep}, chunks of {args.chunk_tokens}"
    )
    _ttft(plain, _request(info.tokenizer, 512, "w0"), args.prefill_chunk)  # warm-up
    _ttft(sparse, _request(info.tokenizer, 512, "w1"), args.prefill_chunk)
    rows = []
    for length in args.lengths:
        full, _ = _ttft(plain, _request(info.tokenizer, length, f"p{length}"), args.prefill_chunk)
        before = sp.stats.skipped_tokens
        ttft, scoring = _ttft(
            sparse, _request(info.tokenizer, length, f"s{length}"), args.prefill_chunk
        )
        skipped = sp.stats.skipped_tokens - before
        print(
            f"{length:6d} tokens: full prefill TTFT {full:6.2f}s | SpecPrefill TTFT {ttft:6.2f}s"
            f" (x{full / ttft:.2f}; scoring {scoring:.2f}s, prefill only {ttft - scoring:.2f}s,"
            f" x{full / (ttft - scoring):.2f}) | prefilled {length - skipped} of {length}"
        )
        rows.append({"workload": f"{length}-token prompt", "metric": "TTFT", "unit": "s",
                     "better": "lower", "mlxd": ttft, "peer": full})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="model dir or .gguf; default SmolLM2-135M")
    parser.add_argument("--scorer", default="", help="scorer model dir; default the model itself")
    parser.add_argument("--cache-dir", default="~/.cache/mlxd")
    parser.add_argument("--keep", type=float, default=0.3)
    parser.add_argument("--chunk-tokens", type=int, default=64)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8000])
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(blas.status())
    rows = bench(args)
    from mlxd.scripts import records  # docs/benchmarks.md is rendered from the records

    command = records.command(argv, module="mlxd.scripts.bench_spec_prefill")
    records.write("bench_spec_prefill", command=command, peer="full prefill", rows=rows)
    return 0


if __name__ == "__main__":
    blas.reexec_with_openblas("mlxd.scripts.bench_spec_prefill")
    raise SystemExit(main())
