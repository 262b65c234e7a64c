"""The disk tier's write rate: bytes written per new token in a growing conversation.

One agent conversation in-process (the engine, its prefix cache and a disk store, no
HTTP): a ``--system-tokens`` prompt, then ``--turns`` turns, each adding ``--user-tokens``
of tool output and ``--max-tokens`` greedy tokens of answer. Every snapshot the prefix
cache makes is written behind (the store's queue is flushed after each turn, as
``disk_write_behind_s`` would write it: a turn's snapshots coalesce as they do there).
The same conversation runs with attention KV in ``--block-tokens`` blocks and with whole
snapshots (``disk_block_tokens = 0``, every snapshot written in full), and the script
prints the bytes written per new (prefilled or generated) token after the first turn,
and the KV bytes a token holds in RAM, for comparison.

    python -m mlxd.scripts.bench_disk_writes                       # SmolLM2 and the tiny hybrid
    python -m mlxd.scripts.bench_disk_writes --model default --turns 12
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

from mlxd.actors.engine.runner.disk_tier import DiskStore
from mlxd.protocol.messages import SamplingParams, TokenizedRequest


def model_dir(name: str, tmp: Path) -> tuple[Path, str]:
    from mlxd.actors.engine.loading.gguf.convert import convert_gguf, default_model_path

    smol = convert_gguf(default_model_path(), tmp / "gguf", lambda _: None)
    if name == "default":
        return smol, "SmolLM2-135M-Instruct (Q4_1 GGUF, as mlxd loads it)"
    from mlxd.scripts import tiny_models as tm

    return tm.build_text_model(tm.QWEN3_5, smol, tmp / "hybrid"), "tiny Qwen3.5 hybrid (tests)"


def conversation(path: Path, tmp: Path, args, block_tokens: int) -> tuple[int, int, int]:
    """(new tokens after turn 1, bytes written for them, KV bytes per token in RAM)."""
    from mlxd.actors.engine.loading.load import load_runner
    from mlxd.actors.engine.scheduler.core import EngineCore
    from mlxd.actors.engine.scheduler.options import DiskTierOptions, PrefixCacheOptions

    store = DiskStore(
        tmp / f"disk-{block_tokens}", 1 << 40, ["m"], write_behind_s=3600, block_tokens=block_tokens
    )
    runner, _ = load_runner(
        str(path),
        tmp,
        dequantize_on_cpu=True,
        max_batch=1,
        prefix_cache=PrefixCacheOptions(block_size=64, max_bytes=4 << 30),
        disk_tier=DiskTierOptions(store=store, slug="m"),
    )
    core = EngineCore(runner, max_batch=1, prefill_chunk_tokens=512)
    rng = random.Random(0)
    tokens = [rng.randrange(10, 40000) for _ in range(args.system_tokens)]
    after_first = written = 0
    for turn in range(args.turns):
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        core.submit(
            TokenizedRequest(request_id=f"t{turn}", prompt_tokens=tuple(tokens), sampling=sampling)
        )
        out: list[int] = []
        while not core.idle:
            out += [x for t in core.step().tokens for x in t.tokens]
        store.flush()
        if turn == 0:
            after_first, written = len(tokens) + len(out), store.counters().bytes_written
        tokens += out + [rng.randrange(10, 40000) for _ in range(args.user_tokens)]
    c = store.counters()
    new = len(tokens) - args.user_tokens - after_first
    per_token = runner.prefix_cache.stats.bytes // max(1, runner.prefix_cache.stats.entries)
    store.close()
    return new, c.bytes_written - written, per_token // max(1, len(tokens) - args.user_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default,hybrid")
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--user-tokens", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--block-tokens", type=int, default=256)
    args = parser.parse_args()
    figures = {}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        for name in args.model.split(","):
            path, label = model_dir(name, tmp)
            print(
                f"{label}: {args.system_tokens}-token start, {args.turns} turns of "
                f"{args.user_tokens} + {args.max_tokens} tokens"
            )
            for block in (args.block_tokens, 0):
                new, written, kv = conversation(path, tmp, args, block)
                how = f"blocks of {block}" if block else "whole snapshots"
                print(
                    f"  {how:>18}: {written / new / 1024:8.1f} KiB written per new token "
                    f"({written / 2**20:.1f} MiB for {new} tokens; RAM holds ~{kv / 1024:.1f} KiB/token)"
                )
                figures[f"{label}, {how}: KiB written per new token"] = written / new / 1024
                figures[f"{label}: RAM KV per token (KiB)"] = kv / 1024
    from mlxd.scripts import records  # docs/benchmarks.md is rendered from the records

    command = records.command(module="mlxd.scripts.bench_disk_writes")
    records.write("bench_disk_writes", command=command, figures=figures)


if __name__ == "__main__":
    main()
