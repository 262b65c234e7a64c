"""Decode throughput of a mixed image + text batch vs the same requests one at a time.

Builds the tiny random-weight test models (``scripts/tiny_models.py``) in a temporary
directory and drives the real runner in-process: every request is prefilled first
(untimed), then decode steps are timed until all finish. Prints numbers; asserts
nothing. Run from the repository root:

    .venv/bin/python -m mlxd.scripts.bench_vlm [--models qwen2_vl,qwen3_5_vl] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from mlxd.daemon import blas


def _requests(builder, n: int, max_tokens: int):
    from mlxd.protocol.messages import ChatRequest, ImagePart, Message, SamplingParams, TextPart
    from mlxd.scripts.tiny_models import data_url, png

    out = []
    for i in range(n):
        text = ["What is in this picture?", "Tell me a story about a cat."][i % 2]
        content: str | tuple[ImagePart | TextPart, ...] = text
        if i % 2 == 0:
            image = data_url(png(60 + 8 * i, 48, seed=i))
            content = (ImagePart(url=image), TextPart(text=text))
        request = ChatRequest(
            request_id=f"r{i}",
            messages=(Message(role="user", content=content),),
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        )
        out.append(builder.build(request))
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


def bench(model_dir: Path, n: int, max_tokens: int) -> dict:
    from mlxd.actors.engine.loading.load import load_runner
    from mlxd.actors.tokenizer import PromptBuilder
    from mlxd.actors.vision import ImageLimits

    runner, info = load_runner(str(model_dir), model_dir, dequantize_on_cpu=True, max_batch=n)
    builder = PromptBuilder(
        info.tokenizer,
        info.context_length,
        default_max_tokens=max_tokens,
        vocab_size=info.vocab_size,
        processor=info.processor,
        image_limits=ImageLimits(4, 1 << 22, 1 << 22, False, 1.0),
    )
    requests = _requests(builder, n, max_tokens)
    _decode_rate(runner, requests[:2])  # warm-up
    batch_tokens, batch_s = _decode_rate(runner, requests)
    one_tokens, one_s = 0, 0.0
    for r in requests:
        t, s = _decode_rate(runner, [r])
        one_tokens, one_s = one_tokens + t, one_s + s
    print(
        f"{model_dir.name:12s} batch of {n} (4 image + 4 text): {batch_tokens / batch_s:7.1f} tok/s"
        f" | one at a time: {one_tokens / one_s:7.1f} tok/s"
        f" | speed-up x{(batch_tokens / batch_s) / (one_tokens / one_s):.2f}"
        f" ({batch_tokens} tokens each way)"
    )
    return {"workload": f"{model_dir.name}, {n} requests", "metric": "tok/s", "better": "higher",
            "mlxd": batch_tokens / batch_s, "peer": one_tokens / one_s}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen2_vl,qwen3_5_vl")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(blas.status())
    from mlxd.actors.engine.loading.gguf.convert import convert_gguf, default_model_path
    from mlxd.scripts import tiny_models as tm

    configs = {"qwen2_vl": tm.qwen2_vl_config, "qwen3_5_vl": tm.qwen3_5_vl_config}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokenizer = convert_gguf(default_model_path(), root / "gguf", lambda _: None)
        for name in args.models.split(","):
            model_dir = tm.build_vlm(configs[name](), tokenizer, root / name)
            rows.append(bench(model_dir, args.requests, args.max_tokens))
    from mlxd.scripts import records  # docs/benchmarks.md is rendered from the records

    command = records.command(argv, module="mlxd.scripts.bench_vlm")
    records.write("bench_vlm", command=command, peer="one request at a time", rows=rows)
    return 0


if __name__ == "__main__":
    blas.reexec_with_openblas("mlxd.scripts.bench_vlm")
    raise SystemExit(main())
