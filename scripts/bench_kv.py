"""Quantized KV (``engine.kv_bits`` 8 and 4) against the model's precision, in one run.

For each of kv_bits 0 (off), 8 and 4, on the model mlxd serves:

- KV bytes per token, as the engine's memory model counts them (measured on the caches
  the runner really makes: packs plus scales and biases for quantized layers), and the
  most concurrent ``--context``-token contexts that fit a fixed ``--budget-gib`` budget:
  ``budget // MemoryModel.request_bytes(context, 0)`` (the memory gate's own estimate:
  every attention layer's bytes per token times the context rounded up to the cache's
  allocation step, plus each recurrent layer's fixed state);
- decode tokens/s with 8 and 32 requests decoding together in the engine's continuous
  batch (``EngineCore``, distinct prompts, no prefix-cache hits), best of ``--repeat``,
  and the ratio against kv_bits 0 measured in the same run;
- agreement with full precision over ``--agree-tokens`` greedy tokens per prompt: the
  full-precision greedy continuation is teacher-forced through a quantized cache (the
  runner's ``kv_quant.quantized`` caches, one forward over prompt + continuation) and
  the script reports the mean and max |delta log-prob| of the chosen tokens, the share
  of positions where the quantized argmax is the same token, and the first position
  where free-running greedy decoding with the quantized cache differs (step by step).

    python -m mlxd.scripts.bench_kv                       # SmolLM2; small sizes (~5 min)
    python -m mlxd.scripts.bench_kv --model hybrid
    python -m mlxd.scripts.bench_kv --model default,hybrid --decode-tokens 64 --agree-prompts 4

``default`` and ``hybrid`` are bench_agents' models.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from mlxd.scripts.bench_agents import prepare

BITS = (0, 8, 4)
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


def encode(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


# ---- engine: bytes per token and decode throughput ---------------------------------------


def load_engine(model_dir: Path, bits: int, group_size: int):
    from mlxd.actors.engine.loading.load import load_runner
    from mlxd.actors.engine.scheduler.options import MemoryOptions

    return load_runner(
        str(model_dir),
        Path("~/.cache/mlxd").expanduser(),
        dequantize_on_cpu=True,
        max_batch=32,
        kv_bits=bits,
        kv_group_size=group_size,
        memory=MemoryOptions(kv_budget_mb=8192, set_mlx_limit=False),
    )


def decode_rate(runner, prompts: dict[str, list[int]], tokens: int) -> float:
    """Decode tokens/s once every request of ``prompts`` decodes (prefill excluded)."""
    from mlxd.actors.engine.scheduler.core import EngineCore
    from mlxd.protocol.messages import SamplingParams, TokenizedRequest

    core = EngineCore(runner, max_batch=32, prefill_chunk_tokens=512)
    for rid, prompt in prompts.items():
        sampling = SamplingParams(max_tokens=tokens, temperature=0.0)
        core.submit(
            TokenizedRequest(request_id=rid, prompt_tokens=tuple(prompt), sampling=sampling)
        )
    start, counted = None, 0
    while not core.idle:
        step = core.step()
        if start is not None:
            counted += sum(len(t.tokens) for t in step.tokens)
        if start is None and runner.decoding == len(prompts):
            start = time.perf_counter()
    return counted / (time.perf_counter() - start)


def engine_numbers(model_dir: Path, bits: int, args: argparse.Namespace) -> dict:
    from mlxd.actors.engine.scheduler.memory import MemoryModel

    runner, info = load_engine(model_dir, bits, args.group_size)
    memory = info.memory
    budget = int(args.budget_gib * 2**30)
    per_context = MemoryModel(layers=memory.layers, budget_bytes=budget).request_bytes(
        args.context, 0
    )
    out = {
        "kv_bytes_per_token": memory.kv_bytes_per_token,
        "state_bytes": memory.state_bytes,
        "context_bytes": per_context,
        "contexts_fitting": budget // per_context,
        "decode_tok_s": {},
    }
    tokenizer = info.tokenizer
    base = [encode(tokenizer, p) for p in PROMPTS]
    serial = 0
    for batch in args.batches:
        rates = []
        for _ in range(args.repeat):
            prompts = {}
            for i in range(batch):  # a distinct leading token per row: no shared prefix
                serial += 1
                prompts[f"r{serial}"] = [serial % 1000 + 10, *base[i % len(base)]]
            rates.append(decode_rate(runner, prompts, args.decode_tokens))
            runner.clear_cache()
        out["decode_tok_s"][batch] = max(rates)
    del runner
    return out


# ---- model: agreement with full precision -------------------------------------------------


def _logprobs(logits):
    import mlx.core as mx

    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def make_cache(model, bits: int, group_size: int) -> list:
    from mlx_lm.models.cache import make_prompt_cache
    from mlxd.actors.engine.runner.kv_quant import quantized

    cache = make_prompt_cache(model)
    return quantized(cache, bits, group_size) if bits else cache


def greedy(
    model, prompt: list[int], n: int, bits: int, group_size: int
) -> tuple[list[int], list[float]]:
    """Free-running greedy decoding, one token a step: the tokens and their log-probs."""
    import mlx.core as mx

    cache = make_cache(model, bits, group_size)
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    tokens, lps = [], []
    for _ in range(n):
        lp = _logprobs(logits)[0]
        tok = int(mx.argmax(lp).item())
        tokens.append(tok)
        lps.append(float(lp[tok].item()))
        logits = model(mx.array([[tok]]), cache=cache)[:, -1]
    return tokens, lps


def forced(model, prompt: list[int], tokens: list[int], bits: int, group_size: int):
    """Teacher-force ``tokens`` after ``prompt`` through a (quantized) cache: the chosen
    tokens' log-probs and the model's own argmax at each position."""
    import mlx.core as mx

    cache = make_cache(model, bits, group_size)
    logits = model(mx.array([prompt + tokens[:-1]]), cache=cache)[0, len(prompt) - 1 :]
    lp = _logprobs(logits)
    chosen = mx.take_along_axis(lp, mx.array(tokens)[:, None], axis=-1)[:, 0]
    return chosen.tolist(), mx.argmax(lp, axis=-1).tolist()


def agreement(model_dir: Path, args: argparse.Namespace) -> dict[int, dict]:
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    prompts = [encode(tokenizer, p) for p in PROMPTS[: args.agree_prompts]]
    full = [greedy(model, p, args.agree_tokens, 0, args.group_size) for p in prompts]
    out: dict[int, dict] = {}
    for bits in BITS:
        deltas, same, diverge = [], 0, []
        for prompt, (tokens, lps) in zip(prompts, full, strict=True):
            q_lps, q_argmax = forced(model, prompt, tokens, bits, args.group_size)
            deltas += [abs(a - b) for a, b in zip(q_lps, lps, strict=True)]
            same += sum(a == b for a, b in zip(q_argmax, tokens, strict=True))
            if bits:
                free, _ = greedy(model, prompt, args.agree_tokens, bits, args.group_size)
                diverge.append(
                    next(
                        (i for i, (a, b) in enumerate(zip(free, tokens, strict=True)) if a != b),
                        None,
                    )
                )
        out[bits] = {
            "mean_abs_dlogprob": sum(deltas) / len(deltas),
            "max_abs_dlogprob": max(deltas),
            "forced_argmax_agreement": same / len(deltas),
            "free_first_divergence": diverge,
        }
    return out


def bench_model(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    model_dir, description = prepare(name, tmp / name)
    print(f"\nmodel {name}: {description}", flush=True)
    engine = {}
    for bits in BITS:
        t0 = time.perf_counter()
        engine[bits] = engine_numbers(model_dir, bits, args)
        print(f"  kv_bits {bits}: engine numbers in {time.perf_counter() - t0:.0f} s", flush=True)
    t0 = time.perf_counter()
    agree = agreement(model_dir, args)
    print(f"  agreement in {time.perf_counter() - t0:.0f} s", flush=True)
    base = engine[0]
    print(
        f"  budget {args.budget_gib:g} GiB, {args.context}-token contexts; decode: "
        f"{args.decode_tokens} tokens per request, best of {args.repeat}; agreement: "
        f"{args.agree_prompts} prompt(s) x {args.agree_tokens} greedy tokens, group size {args.group_size}"
    )
    for bits in BITS:
        e, a = engine[bits], agree[bits]
        rates = ", ".join(
            f"batch {b} {r:.1f} tok/s (x{r / base['decode_tok_s'][b]:.2f})"
            for b, r in e["decode_tok_s"].items()
        )
        print(
            f"  kv_bits {bits}: {e['kv_bytes_per_token']} KV bytes/token "
            f"({e['kv_bytes_per_token'] / base['kv_bytes_per_token']:.3f} of off), "
            f"{e['context_bytes'] / 2**20:.0f} MiB per context -> {e['contexts_fitting']} contexts "
            f"(x{e['contexts_fitting'] / max(base['contexts_fitting'], 1):.2f} of off); {rates}"
        )
        if bits:
            print(
                f"    vs full precision: mean |dlogprob| {a['mean_abs_dlogprob']:.4f} "
                f"(max {a['max_abs_dlogprob']:.3f}), teacher-forced argmax agreement "
                f"{a['forced_argmax_agreement']:.3f}, free-running greedy first divergence "
                f"{a['free_first_divergence']} (None: identical for all {args.agree_tokens})"
            )
        else:
            print(
                f"    full precision, one forward vs step by step: mean |dlogprob| "
                f"{a['mean_abs_dlogprob']:.5f} (numerical floor), argmax agreement "
                f"{a['forced_argmax_agreement']:.3f}"
            )
    return {"model": name, "description": description, "engine": engine, "agreement": agree}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_kv", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default="default", help="default, hybrid, DIR or FILE.gguf; a comma list"
    )
    p.add_argument("--budget-gib", type=float, default=16.0, help="the fixed KV memory budget")
    p.add_argument("--context", type=int, default=8192, help="tokens per context for the budget")
    p.add_argument("--batches", default="8,32", help="decode batch sizes, a comma list")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens per request when decoding")
    p.add_argument("--repeat", type=int, default=2, help="decode runs per batch size (best kept)")
    p.add_argument("--agree-tokens", type=int, default=512, help="greedy tokens compared")
    p.add_argument("--agree-prompts", type=int, default=1, help="prompts compared")
    p.add_argument("--group-size", type=int, default=64, help="engine.kv_group_size")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import importlib.metadata

    from mlxd.scripts.bench_agents import _revision

    print(
        f"mlxd {_revision()}, mlx-lm {importlib.metadata.version('mlx-lm')}, "
        f"mlx {importlib.metadata.version('mlx')}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    with tempfile.TemporaryDirectory(prefix="bench_kv.") as tmp:
        results = [bench_model(name, args, Path(tmp)) for name in args.model.split(",")]
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    from mlxd.scripts import records  # docs/benchmarks.md is rendered from the records

    command = records.command(argv, module="mlxd.scripts.bench_kv")
    records.write("bench_kv", command=command, peer="kv_bits 0 (full precision)",
                  figures=records.numbers(results))  # fmt: skip
    return 0


if __name__ == "__main__":
    from mlxd.daemon import blas

    blas.reexec_with_openblas("mlxd.scripts.bench_kv")
    raise SystemExit(main())
