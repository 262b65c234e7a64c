"""Drive the real engine core step by step, so requests join and leave at exact steps."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from mlxd.actors.engine.scheduler.core import EngineCore
from mlxd.protocol.messages import Failed, SamplingParams, TokenizedRequest


def load(model_dir: Path, max_batch: int = 8, kind: str = "auto"):
    from mlxd.actors.engine.loading.load import load_runner

    return load_runner(
        str(model_dir), model_dir, dequantize_on_cpu=True, max_batch=max_batch, kind=kind
    )


def speculative_runner(model_dir: Path, make_drafter, *, k=3, spec_max_batch=8, max_batch=8):
    """(plain runner, speculative runner, info) over one loaded target; ``make_drafter``
    takes the target model and returns a ``Drafter`` or a draft model."""
    from mlxd.actors.engine.speculative.runner import SpeculativeRunner

    plain, info = load(model_dir, max_batch)
    runner = SpeculativeRunner(
        plain.model,
        make_drafter(plain.model),
        sorted(info.tokenizer.eos_token_ids),
        max_batch,
        num_draft=k,
        spec_max_batch=spec_max_batch,
    )
    return plain, runner, info


def request(rid: str, tokens, max_tokens: int = 10, vision=None) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=rid,
        prompt_tokens=tuple(tokens),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        vision=vision,
    )


def drive(
    runner,
    schedule: dict[int, list[TokenizedRequest]],
    aborts: dict[int, list[str]] | None = None,
    *,
    max_batch: int = 8,
    prefill_chunk_tokens: int = 16,
) -> tuple[dict[str, list[int]], dict[str, Failed]]:
    """Submit ``schedule[step]`` before engine step ``step``; run until idle.

    Returns every request's generated tokens and the failures.
    """
    core = EngineCore(runner, max_batch=max_batch, prefill_chunk_tokens=prefill_chunk_tokens)
    tokens: dict[str, list[int]] = defaultdict(list)
    failed: dict[str, Failed] = {}
    last = max(schedule)
    step = 0
    while step <= last or not core.idle:
        for r in schedule.get(step, []):
            core.submit(r)
        for rid in (aborts or {}).get(step, []):
            core.abort(rid)
        result = core.step()
        for t in result.tokens:
            tokens[t.request_id].extend(t.tokens)
        for f in result.failed:
            failed[f.request_id] = f
        step += 1
    return dict(tokens), failed


def alone(runner, requests: list[TokenizedRequest], **kwargs) -> dict[str, list[int]]:
    """Each request's tokens when it runs by itself."""
    out: dict[str, list[int]] = {}
    for r in requests:
        tokens, failed = drive(runner, {0: [r]}, **kwargs)
        assert not failed, failed
        out[r.request_id] = tokens[r.request_id]
    return out


def until_idle(core) -> dict[str, list[int]]:
    """Step ``core`` until it is idle, asserting no request failed; every request's tokens."""
    tokens: dict[str, list[int]] = {}
    while not core.idle:
        step = core.step()
        assert not step.failed, step.failed
        for t in step.tokens:
            tokens.setdefault(t.request_id, []).extend(t.tokens)
    return tokens
