"""Admission on use against whole reservations (``memory.admission``), in the engine.

Agents with long contexts and a large ``max_tokens`` arrive at once; each answer is
short or long (the row is ended, as a stop string or the client would end it, once it
has that many tokens). The KV budget holds exactly ``--fit`` whole reservations
(prompt + ``max_tokens``). Under "reserve" that is how many run at once; under "use" a
row is admitted on prompt + ``memory.decode_reserve_tokens`` and the newest row is
preempted when growth would not fit (resumed from its prefix-cache snapshot, or by
recompute). For each mix and policy it reports the most rows running at once and
their mean per decode step, the wall time, TTFT p50 / p95 and the preemptions.

The issue's scale (8k-token contexts, ``max_tokens`` 16,384, answers of ~200 and
~4,000 tokens, a budget of 4 reservations) takes hours on a 2-core CPU, where MLX also
compiles kernels for every new batch shape (minutes of the first pass: an untimed
warm-up pass runs first). The defaults are scaled down to SmolLM2-135M (float32),
12 agents with 256-token contexts, ``max_tokens`` 768, answers of 16 and 200 tokens,
a budget of 4 reservations and ``decode_reserve_tokens`` 32 (about 25 minutes on a
shared 2-core VM). At this scale mlx-lm's 256-token allocation step rounds each
admitted row up to 512 tokens, so "use" fits 8 rows, not 12; at 8k contexts the
rounding is negligible. The ratios, not the seconds, are the result.

    python -m mlxd.scripts.bench_memory
    python -m mlxd.scripts.bench_memory --agents 16 --context 8192 --max-tokens 16384 \\
        --short 200 --long 4000 --reserve-tokens 256          # the issue's scale (a GPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

from mlxd.scripts.bench_agents import prepare

FILLER = (
    "The build failed in the integration tests after the dependency upgrade; the log "
    "shows a timeout in the storage layer and a retry loop that never backs off. "
)


def agent_prompt(tokenizer, i: int, context: int) -> tuple[int, ...]:
    """A distinct ``context``-token prompt per agent (its id first: no shared prefix)."""
    text = f"Agent {i} reporting. " + FILLER * (context // 20)
    tokens = tokenizer.encode(text)[:context]
    return tuple(tokens)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run(runner, memory, prompts: list[tuple[int, ...]], answer: int, max_tokens: int) -> dict:
    """All agents at once; each row ends (abort, as a stop string would) at ``answer``."""
    from mlxd.actors.engine.scheduler.core import EngineCore
    from mlxd.protocol.messages import SamplingParams, TokenizedRequest

    runner.clear_cache()
    core = EngineCore(runner, max_batch=32, prefill_chunk_tokens=512, memory=memory)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, prompt in enumerate(prompts):
        core.submit(TokenizedRequest(request_id=f"a{i}", prompt_tokens=prompt, sampling=sampling))
    start = time.perf_counter()
    got: dict[str, int] = {}
    ttft: dict[str, float] = {}
    most, rows, steps = 0, 0, 0
    while not core.idle:
        step = core.step()
        most = max(most, len(core.decoding) + len(core.prefilling))
        if core.decoding:
            rows, steps = rows + len(core.decoding), steps + 1
        for t in step.tokens:
            got[t.request_id] = got.get(t.request_id, 0) + len(t.tokens)
            ttft.setdefault(t.request_id, time.perf_counter() - start)
            if got[t.request_id] >= answer and t.finish_reason is None:
                core.abort(t.request_id)  # the answer is complete
        assert not step.failed, step.failed
    stats = core.stats()
    return {
        "most_running": most,
        "mean_running": round(rows / max(steps, 1), 2),
        "wall_s": round(time.perf_counter() - start, 2),
        "ttft_p50_s": round(percentile(list(ttft.values()), 0.5), 2),
        "ttft_p95_s": round(percentile(list(ttft.values()), 0.95), 2),
        "preemptions": stats.preemptions,
        "resumes": stats.resumes,
        "preempted_mib": round(stats.preempted_bytes / 2**20, 1),
    }


def load(model_dir: Path, budget_mb: int):
    from mlxd.actors.engine.loading.load import load_runner
    from mlxd.actors.engine.scheduler.options import MemoryOptions, PrefixCacheOptions

    return load_runner(
        str(model_dir),
        Path("~/.cache/mlxd").expanduser(),
        dequantize_on_cpu=True,
        max_batch=32,
        prefix_cache=PrefixCacheOptions(max_bytes=budget_mb << 20),
        memory=MemoryOptions(kv_budget_mb=budget_mb, set_mlx_limit=False),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    p.add_argument("--model", default="default", help="default (SmolLM2), hybrid, or a path")
    p.add_argument("--agents", type=int, default=12)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=768)
    p.add_argument("--short", type=int, default=16)
    p.add_argument("--long", type=int, default=200)
    p.add_argument("--fit", type=int, default=4, help="whole reservations the budget holds")
    p.add_argument("--reserve-tokens", type=int, default=32)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, label = prepare(args.model, Path(tmp))
        runner, info = load(model_dir, 1024)
        full = info.memory.request_bytes(args.context, args.max_tokens)
        prompts = [agent_prompt(info.tokenizer, i, args.context) for i in range(args.agents)]
        report = {"model": label, "scale": vars(args), "budget_mib": full * args.fit / 2**20}
        # untimed: MLX's CPU backend compiles kernels for each new batch shape (tens of
        # seconds each on 2 cores); the serving warm-up does this before "ready"
        for mix, answer in (("warm-up", 2), ("short", args.short), ("long", args.long)):
            for admission in ("reserve", "use"):
                memory = dataclasses.replace(
                    info.memory,
                    budget_bytes=full * args.fit,
                    admission=admission,
                    reserve_tokens=args.reserve_tokens,
                )
                result = run(runner, memory, prompts, answer, args.max_tokens)
                if mix != "warm-up":
                    report[f"{mix}/{admission}"] = result
                print(mix, admission, json.dumps(result), flush=True)
        print(json.dumps(report, indent=2))
    from mlxd.scripts import records  # docs/benchmarks.md is rendered from the records

    command = records.command(module="mlxd.scripts.bench_memory")
    records.write("bench_memory", command=command, peer='memory.admission = "reserve"',
                  figures=records.numbers(report))  # fmt: skip


if __name__ == "__main__":
    main()
