"""Quantized KV (``engine.kv_bits``) against the model's precision, in one run.

Prints, for kv_bits 0 (off), 8 and 4: the KV bytes per token the memory gate counts,
greedy agreement with kv_bits 0 (the first position where the tokens differ, per
prompt), and decode tokens/s with ``--concurrency`` requests decoding together (the
ratio against kv_bits 0 measured in the same run, ``--repeat`` times).

    .venv/bin/python -m mlxd.scripts.bench_kv_quant [--model PATH] [--tokens 64]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in three sentences why the sky is blue.",
    "List five prime numbers and say how you found them.",
    "Summarise the plot of Romeo and Juliet in a short paragraph.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a recipe for pancakes.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Describe how a hash map works.",
)


def load(model: str, cache_dir: Path, bits: int):
    from mlxd.actors.engine.loading.load import load_runner
    from mlxd.actors.engine.scheduler.options import MemoryOptions

    return load_runner(
        model,
        cache_dir,
        dequantize_on_cpu=True,
        max_batch=32,
        kv_bits=bits,
        memory=MemoryOptions(kv_budget_mb=4096, set_mlx_limit=False),
    )


def encode(info, text: str) -> tuple[int, ...]:
    messages = [{"role": "user", "content": text}]
    return tuple(info.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def generate(runner, prompts: dict[str, tuple[int, ...]], tokens: int) -> tuple[dict, float]:
    """Greedy tokens per request, and decode tokens/s once every request decodes."""
    from mlxd.actors.engine.scheduler.core import EngineCore
    from mlxd.protocol.messages import SamplingParams, TokenizedRequest

    core = EngineCore(runner, max_batch=32, prefill_chunk_tokens=512)
    for rid, prompt in prompts.items():
        sampling = SamplingParams(max_tokens=tokens, temperature=0.0)
        core.submit(TokenizedRequest(request_id=rid, prompt_tokens=prompt, sampling=sampling))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    start, counted = None, 0
    while not core.idle:
        step = core.step()
        for t in step.tokens:
            out[t.request_id].extend(t.tokens)
            counted += len(t.tokens) if start is not None else 0
        if start is None and runner.decoding == len(prompts):
            start = time.perf_counter()
    return out, counted / (time.perf_counter() - start)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="default: SmolLM2 (GGUF)")
    parser.add_argument("--cache-dir", default="~/.cache/mlxd", help="converted GGUF files")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    model, cache_dir = args.model, Path(args.cache_dir).expanduser()
    results = {}
    for bits in (0, 8, 4):
        runner, info = load(model, cache_dir, bits)
        prompts = {f"p{i}": encode(info, p) for i, p in enumerate(PROMPTS[: args.concurrency])}
        alone = {}
        for rid, prompt in prompts.items():  # greedy answers, one request at a time
            alone |= generate(runner, {rid: prompt}, args.tokens)[0]
        runner.clear_cache()
        rates = []
        for n in range(args.repeat):  # distinct prompts each time: no prefix-cache hit
            batch = {f"{rid}-{n}": (n + 1, *p) for rid, p in prompts.items()}
            rates.append(generate(runner, batch, args.tokens)[1])
            runner.clear_cache()
        results[bits] = (info.memory.kv_bytes_per_token, alone, rates)
    base_bytes, base_tokens, base_rates = results[0]
    print(
        f"model: {model or 'SmolLM2 (default)'}; {args.tokens} greedy tokens; concurrency {args.concurrency}"
    )
    for bits, (per_token, tokens, rates) in results.items():
        diverge = [first_difference(tokens[r], base_tokens[r]) for r in tokens]
        same = sum(d is None for d in diverge)
        ratios = " ".join(f"{r / b:.2f}" for r, b in zip(rates, base_rates, strict=True))
        print(
            f"kv_bits {bits}: {per_token} KV bytes/token ({per_token / base_bytes:.3f} of off); "
            f"greedy identical to off in {same}/{len(diverge)} prompts, first divergence at "
            f"{[d for d in diverge if d is not None]}; decode "
            f"{' '.join(f'{r:.1f}' for r in rates)} tok/s (x{ratios} of off)"
        )


if __name__ == "__main__":
    main()
