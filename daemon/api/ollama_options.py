"""Ollama's ``options`` and ``keep_alive``, as mlxd's sampling parameters and pool TTL.

Honoured: ``num_predict`` (-1 and -2: up to the context), ``temperature``, ``top_k``,
``top_p``, ``min_p``, ``seed`` (negative: random), ``stop``, ``repeat_penalty``,
``presence_penalty``, ``frequency_penalty`` and ``num_ctx`` (below the model's context:
the prompt must fit in it, and the answer stops at it). mlxd's penalties look back
over the whole sequence: ``repeat_last_n`` -1 says the same, 0 turns them off, and
any other window is refused while a penalty is on. Refused unless they are off:
``typical_p`` (1), ``tfs_z`` (1), ``mirostat`` (0). Runtime options (``num_thread``,
``num_gpu``, ``num_batch``, ``main_gpu``, ``use_mmap``, ``use_mlock``, ``numa``,
``low_vram``, ``f16_kv``, ``num_keep``, ...) do not change an answer and are ignored,
as are option names Ollama does not know.
"""

from __future__ import annotations

import math
import re

import msgspec
from mlxd.daemon.api.common import Validator, check
from mlxd.protocol import ollama as wire
from mlxd.protocol.messages import SamplingParams

_OFF = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0}


def _refused(o: wire.Options) -> None:
    for name, off in _OFF.items():
        value = getattr(o, name)
        check(
            value is None or value == off,
            f"options.{name}",
            f"{name} is not supported (only {off}, which turns it off)",
        )


def _penalties(o: wire.Options) -> tuple[float, float, float]:
    """(repeat, presence, frequency) penalties, as ``repeat_last_n`` allows them."""
    repeat = 1.0 if o.repeat_penalty is None else o.repeat_penalty
    presence, frequency = o.presence_penalty or 0.0, o.frequency_penalty or 0.0
    if o.repeat_last_n == 0:
        return 1.0, 0.0, 0.0  # Ollama: a window of 0 tokens, no penalty
    active = repeat != 1.0 or presence or frequency
    check(
        not active or o.repeat_last_n in (None, -1),
        "options.repeat_last_n",
        "penalties look back over the whole sequence here; send repeat_last_n -1 (or omit it)",
    )
    return repeat, presence, frequency


def _max_tokens(num_predict: int | None) -> int | None:
    """-1 (no limit) and -2 (fill the context): up to the context, as mlxd's default."""
    return None if num_predict in (None, -1, -2) else num_predict


def sampling_from(
    options: wire.Options | None, v: Validator, logprobs: bool, top_logprobs: int
) -> SamplingParams:
    """``options`` as mlxd's sampling parameters (range-checked by the validator); what
    is not given takes mlxd's defaults, as on the OpenAI routes."""
    o = options or wire.Options()
    _refused(o)
    v.in_range(o.num_ctx, "options.num_ctx")
    v.in_range(o.seed, "options.seed")  # a negative one is random, but not any length
    check(o.num_ctx is None or o.num_ctx >= 1, "options.num_ctx", "num_ctx must be at least 1")
    repeat, presence, frequency = _penalties(o)
    params = SamplingParams(
        max_tokens=_max_tokens(o.num_predict),
        temperature=1.0 if o.temperature is None else o.temperature,
        top_p=1.0 if o.top_p is None else o.top_p,
        top_k=o.top_k or 0,
        min_p=o.min_p or 0.0,
        repetition_penalty=repeat,
        presence_penalty=presence,
        frequency_penalty=frequency,
        seed=o.seed if o.seed is not None and o.seed >= 0 else None,
        stop=v.stops(o.stop, "options.stop"),
        logprobs=logprobs or top_logprobs > 0,
        top_logprobs=top_logprobs,
    )
    return v.sampling(params, max_tokens_param="options.num_predict")


def within_context(params: SamplingParams, num_ctx: int, prompt_tokens: int) -> SamplingParams:
    """``num_ctx`` as a window: the prompt must fit, the answer stops at its end."""
    check(
        prompt_tokens < num_ctx,
        "options.num_ctx",
        f"the prompt has {prompt_tokens} tokens, which leaves no room in num_ctx {num_ctx}",
    )
    room = num_ctx - prompt_tokens
    asked = params.max_tokens
    return msgspec.structs.replace(params, max_tokens=room if asked is None else min(asked, room))


# Go's duration units (Ollama's keep_alive strings are Go durations: "5m", "1h30m", "-1s").
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def _duration(text: str) -> float | None:
    """A Go duration (or a bare number: seconds) in seconds; None if it is neither."""
    body = text.strip()
    sign = -1.0 if body.startswith("-") else 1.0
    body = body.lstrip("+-")
    try:
        return sign * float(body)
    except ValueError:
        pass
    total, at = 0.0, 0
    for m in _PART.finditer(body):
        if m.start() != at:
            return None
        total += float(m.group(1)) * _UNITS[m.group(2)]
        at = m.end()
    return sign * total if body and at == len(body) else None


def keep_alive_seconds(value: wire.KeepAliveValue) -> float | None:
    """``keep_alive`` in seconds: 0 unloads once idle, negative (inf) never; None: none
    given (the pool's ``model_pool.idle_unload_s``)."""
    if value is None:
        return None
    seconds = _duration(value) if isinstance(value, str) else float(value)
    check(
        seconds is not None and not math.isnan(seconds),
        "keep_alive",
        'keep_alive must be seconds or a duration such as "5m", "1h" or "-1" (forever)',
    )
    assert seconds is not None
    return math.inf if seconds < 0 else seconds
