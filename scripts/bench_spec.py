"""Decode tok/s with and without speculative decoding, at several concurrencies.

Loads the default model (or ``--model``) and drives the real runners in-process:
every request is prefilled first (untimed), then decode steps are timed until all
finish. The draft is the model itself unless ``--draft`` names another, so the
acceptance rate is an upper bound and the speed shows what verification costs on
this backend; ``--draft-layers N`` drafts with the model's first N layers (its own
norm and head: a cheap draft sharing every weight). The concurrency where the
speed-up falls below 1 is what ``speculative.max_batch`` should be set under.
``--lookup`` drafts by prompt lookup instead (n-gram matches in each request's own
tokens, no model); ``--workload copy`` asks for code back with a small change, the
copy-heavy case lookup is for. Prints numbers; asserts nothing. Run from the
repository root:

    .venv/bin/python -m mlxd.scripts.bench_spec [--draft DIR | --draft-layers N | --lookup]
        [--workload chat|copy] [--k 3] [--max-tokens 64] [--concurrency 1,2,4,8,16]
    .venv/bin/python -m mlxd.scripts.bench_spec --verify-cost [--concurrency 1,2,4,8,16,32]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from mlxd.daemon import blas

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


# Copy-heavy: code to give back with one change (what agents and editors ask for).
CODE = [
    """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    out = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out""",
    """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1] if self.items else None""",
    """def parse_config(path):
    settings = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    return settings""",
]
CHANGES = ["Rename the function or class to use a `my_` prefix", "Add a docstring at the top"]


def _copy_prompt(i: int) -> str:
    code, change = CODE[i % len(CODE)], CHANGES[(i // len(CODE)) % len(CHANGES)]
    return f"Here is some Python code:\n\n```python\n{code}\n```\n\n{change}. Reply with the full code."


def _requests(tokenizer, n: int, max_tokens: int, tag: str, workload: str = "chat"):
    from mlxd.protocol.messages import SamplingParams, TokenizedRequest

    out = []
    for i in range(n):
        text = _copy_prompt(i) if workload == "copy" else PROMPTS[i % len(PROMPTS)]
        messages = [{"role": "user", "content": text}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        out.append(
            TokenizedRequest(request_id=f"{tag}{i}", prompt_tokens=tuple(prompt), sampling=sampling)
        )
    return out


def _decode_rate(runner, requests) -> tuple[int, float, int]:
    """Generated tokens, seconds spent in decode steps and row-steps (each running
    request counted once per step), all ``requests`` together."""
    for r in requests:
        runner.start(r)
        while runner.prefill(r.request_id, 1 << 20):
            pass
    tokens, elapsed, row_steps = 0, 0.0, 0
    while runner.decoding:
        row_steps += runner.decoding
        start = time.perf_counter()
        tokens += len(runner.decode())
        elapsed += time.perf_counter() - start
    return tokens, elapsed, row_steps


def _first_layers(model, n: int):
    """The model cut to its first ``n`` layers: same weights (shared), same norm and head."""
    import copy

    draft, inner = copy.copy(model), copy.copy(model.model)
    inner.layers = model.model.layers[:n]
    draft.model = inner
    return draft


def verify_cost(args) -> dict[str, float]:
    """What verification costs per batch size: the time of one forward pass over k+1
    tokens per row against one token per row, on a batch with ``--context`` tokens of
    history per row. With acceptance rate a a step emits E = (1 - a^(k+1)) / (1 - a)
    tokens per row, so speculation pays while E > ratio + k * d, d being one drafted
    token's cost relative to a target step (about 0 for a small draft or an MTP head
    on a big model). ``speculative.max_batch`` is where that stops holding."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlxd.actors.engine.loading.load import load_runner
    from mlxd.actors.engine.speculative.batch import merge_caches

    cache_dir = Path(args.cache_dir).expanduser()
    runner, info = load_runner(args.model, cache_dir, dequantize_on_cpu=True, max_batch=1)
    model, k = runner.model, args.k
    print(f"model {info.model_id} ({info.backend}), k={k}, context {args.context} tokens per row")

    def timed(cache, width: int, reps: int = 5) -> float:
        ids = mx.zeros((len(cache[0].offset), width), mx.int32)
        mx.eval(model(ids, cache=cache))  # warm-up
        for c in cache:
            c.trim(width)
        start = time.perf_counter()
        for _ in range(reps):
            mx.eval(model(ids, cache=cache))
            for c in cache:
                c.trim(width)
        return (time.perf_counter() - start) / reps

    figures = {}
    for n in (int(c) for c in args.concurrency.split(",")):
        rows = []
        for i in range(n):
            cache = make_prompt_cache(model)
            model(mx.arange(i, i + args.context)[None], cache=cache)
            mx.eval([c.state for c in cache])
            rows.append(cache)
        batch = merge_caches(rows)
        one, verify = timed(batch, 1), timed(batch, k + 1)
        ratio = verify / one
        gains = []
        for a in (0.5, 0.7, 0.9):
            e = (1 - a ** (k + 1)) / (1 - a)
            gains.append(f"a={a}: x{e / ratio:.2f} free / x{e / (ratio + k * 0.25):.2f} d=0.25")
        print(
            f"batch {n:3d}: step {one * 1000:7.1f} ms, verify {verify * 1000:7.1f} ms"
            f" (ratio {ratio:.2f}) | speed-up " + ", ".join(gains)
        )
        figures[f"batch {n}: a verify pass / a step"] = ratio
    return figures


def bench(args) -> list[dict]:
    from mlxd.actors.engine.loading.load import load_model, load_runner
    from mlxd.actors.engine.speculative.lookup import LookupDrafter
    from mlxd.actors.engine.speculative.runner import SpeculativeRunner
    from mlxd.scripts import records

    cache_dir = Path(args.cache_dir).expanduser()
    counts = [int(c) for c in args.concurrency.split(",")]
    width = max(counts)
    plain, info = load_runner(args.model, cache_dir, dequantize_on_cpu=True, max_batch=width)
    draft, name = plain.model, "itself"
    if args.lookup:
        draft = LookupDrafter(args.lookup_max_ngram, args.lookup_min_ngram)
        name = f"prompt lookup ({args.lookup_max_ngram}..{args.lookup_min_ngram}-grams)"
    elif args.draft:
        draft, name = load_model(Path(args.draft), dequantize_on_cpu=True)[0], args.draft
    elif args.draft_layers:
        draft, name = (
            _first_layers(plain.model, args.draft_layers),
            f"its first {args.draft_layers} layers",
        )
    stops = sorted(info.tokenizer.eos_token_ids)
    print(f"model {info.model_id} ({info.backend}), draft {name}, k={args.k}, {args.workload}")
    rows = []
    for n in counts:
        spec = SpeculativeRunner(
            plain.model, draft, stops, width, num_draft=args.k, spec_max_batch=width
        )

        def requests(max_tokens, tag, n=n):
            return _requests(info.tokenizer, n, max_tokens, tag, args.workload)

        _decode_rate(plain, requests(8, "w"))  # warm-up
        _decode_rate(spec, requests(8, "w"))
        spec.spec_stats.reset()  # count the timed runs only
        base, fast = 0.0, 0.0
        for _ in range(args.repeat):  # alternating, best of each: the machine is shared
            base_tokens, base_s, _ = _decode_rate(plain, requests(args.max_tokens, "p"))
            spec_tokens, spec_s, row_steps = _decode_rate(spec, requests(args.max_tokens, "s"))
            base, fast = max(base, base_tokens / base_s), max(fast, spec_tokens / spec_s)
        stats = spec.spec_stats
        print(
            f"concurrency {n}: plain {base:7.1f} tok/s | speculative {fast:7.1f} tok/s"
            f" (x{fast / base:.2f}) | acceptance {stats.acceptance_rate:.2f},"
            f" {stats.drafted / args.repeat / row_steps:.2f} drafted and"
            f" {spec_tokens / row_steps:.2f} emitted per request per step"
        )
        workload = f"draft {name}, k = {args.k}, {args.workload}, {n} at once"
        rows.append(records.compared(workload, "tok/s", better="higher", mlxd=fast, peer=base))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="model dir or .gguf; default SmolLM2-135M")
    parser.add_argument("--draft", default="", help="draft model dir; default the model itself")
    parser.add_argument("--cache-dir", default="~/.cache/mlxd")
    parser.add_argument("--draft-layers", type=int, default=0, help="draft with the first N layers")
    parser.add_argument("--lookup", action="store_true", help="draft by prompt lookup (no model)")
    parser.add_argument("--lookup-max-ngram", type=int, default=3)
    parser.add_argument("--lookup-min-ngram", type=int, default=1)
    parser.add_argument(
        "--workload", choices=("chat", "copy"), default="chat", help="copy: code given back"
    )
    parser.add_argument("--concurrency", default="1,8", help="comma-separated request counts")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument(
        "--verify-cost", action="store_true", help="time verify passes per batch size only"
    )
    parser.add_argument("--context", type=int, default=256, help="history per row (--verify-cost)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=1, help="timed runs; the best counts")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(blas.status())
    from mlxd.scripts import records  # docs/benchmarks.md is rendered from the records

    command = records.command(argv, module="mlxd.scripts.bench_spec")
    if args.verify_cost:
        records.write("bench_spec_verify", command=command, figures=verify_cost(args))
    else:
        records.write("bench_spec", command=command, peer="plain decoding", rows=bench(args))
    return 0


if __name__ == "__main__":
    blas.reexec_with_openblas("mlxd.scripts.bench_spec")
    raise SystemExit(main())
