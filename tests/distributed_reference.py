"""mlx-lm's own sharded generation, the reference for ``tests/test_distributed.py``.

Run under ``mlx.launch`` (every rank runs it; rank 0 writes the result):
``python -m tests.distributed_reference SPEC.json OUT.json`` where SPEC is a list of
``{"model": dir, "mode": "tensor" | "pipeline", "prompts": [[token ids]], "max_tokens": n}``.
Each prompt is generated alone, greedily, with mlx-lm's ``sharded_load`` over the group.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import sharded_load


def generate(model, prompt: list[int], max_tokens: int, stops: set[int]) -> list[int]:
    out: list[int] = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        token = int(token)
        if token in stops:
            break
        out.append(token)
    return out


def main(spec_path: str, out_path: str) -> None:
    group = mx.distributed.init()
    results = []
    for spec in json.loads(open(spec_path).read()):
        tensor = group if spec["mode"] == "tensor" else None
        pipeline = group if spec["mode"] == "pipeline" else None
        model, tokenizer = sharded_load(spec["model"], pipeline_group=pipeline, tensor_group=tensor)
        stops = set(tokenizer.eos_token_ids)
        results.append([generate(model, p, spec["max_tokens"], stops) for p in spec["prompts"]])
    if group.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
