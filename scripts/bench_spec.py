"""Decode tok/s with and without speculative decoding, at concurrency 1 and 8.

Loads the default model (or ``--model``) and drives the real runners in-process:
every request is prefilled first (untimed), then decode steps are timed until all
finish. The draft is the model itself unless ``--draft`` names another, so the
acceptance rate is an upper bound and the speed shows what verification costs on
this backend. Prints numbers; asserts nothing. Run from the repository root:

    .venv/bin/python -m scripts.bench_spec [--draft DIR] [--k 3] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from daemon import blas

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash map is.",
    "List five fruits and their colours.",
    "Tell me a story about a cat who learns to fly.",
    "What is the capital of France, and why is it famous?",
    "Give three tips for writing clean Python code.",
    "Describe how rain forms.",
    "Summarise the plot of Romeo and Juliet.",
]


def _requests(tokenizer, n: int, max_tokens: int, tag: str):
    from protocol.messages import SamplingParams, TokenizedRequest

    out = []
    for i in range(n):
        messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        out.append(
            TokenizedRequest(request_id=f"{tag}{i}", prompt_tokens=tuple(prompt), sampling=sampling)
        )
    return out


def _decode_rate(runner, requests) -> tuple[int, float]:
    """Generated tokens and seconds spent in decode steps, all ``requests`` together."""
    for r in requests:
        runner.start(r)
        while runner.prefill(r.request_id, 1 << 20):
            pass
    tokens, elapsed = 0, 0.0
    while runner.decoding:
        start = time.perf_counter()
        tokens += len(runner.decode())
        elapsed += time.perf_counter() - start
    return tokens, elapsed


def bench(args) -> None:
    from actors.engine.runner import load_model, load_runner
    from actors.engine.spec_runner import SpeculativeRunner

    cache_dir = Path(args.cache_dir).expanduser()
    plain, info = load_runner(args.model, cache_dir, dequantize_on_cpu=True, max_batch=8)
    draft = plain.model
    if args.draft:
        draft = load_model(Path(args.draft), dequantize_on_cpu=True)[0]
    stops = sorted(info.tokenizer.eos_token_ids)
    print(
        f"model {info.model_id} ({info.backend}), draft {'itself' if not args.draft else args.draft}, k={args.k}"
    )
    for n in (1, 8):
        spec = SpeculativeRunner(plain.model, draft, stops, 8, num_draft=args.k, spec_max_batch=8)
        _decode_rate(plain, _requests(info.tokenizer, n, 8, "w"))  # warm-up
        _decode_rate(spec, _requests(info.tokenizer, n, 8, "w"))
        spec.spec_stats.__init__()  # count the timed run only
        base_tokens, base_s = _decode_rate(
            plain, _requests(info.tokenizer, n, args.max_tokens, "p")
        )
        spec_tokens, spec_s = _decode_rate(spec, _requests(info.tokenizer, n, args.max_tokens, "s"))
        stats = spec.spec_stats
        print(
            f"concurrency {n}: plain {base_tokens / base_s:7.1f} tok/s | speculative"
            f" {spec_tokens / spec_s:7.1f} tok/s (x{(spec_tokens / spec_s) / (base_tokens / base_s):.2f})"
            f" | acceptance {stats.acceptance_rate:.2f},"
            f" {stats.emitted / max(stats.steps, 1) / n:.2f} tokens per request per verify"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="model dir or .gguf; default SmolLM2-135M")
    parser.add_argument("--draft", default="", help="draft model dir; default the model itself")
    parser.add_argument("--cache-dir", default="~/.cache/mlxd")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(blas.status())
    bench(args)
    return 0


if __name__ == "__main__":
    blas.reexec_with_openblas("scripts.bench_spec")
    raise SystemExit(main())
