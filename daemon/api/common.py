"""What every HTTP API shares: decoding, validation, the request's sessions and usage.

Each API module (``openai.py``, ``anthropic.py``, ``responses.py``) decodes its
wire request, builds internal requests through the ``Validator`` (every limit
from the settings; a field that cannot be honoured is a 400, never dropped),
runs them with ``start`` and shapes the merged ``(choice index, event)``
stream into its own JSON, or its own frames for the one SSE driver
(``sse.py``); ``Usage`` is the token counts each API renders its own way.
Errors and their formats are in ``errors.py``.
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

import msgspec
import trio
from mlxd.actors.grammar import strict_schema_error
from mlxd.actors.mailbox import Bell
from mlxd.actors.tokenizer import RESERVED_TEMPLATE_KWARGS
from mlxd.daemon.api.body import json_depth, valid_utf8
from mlxd.daemon.api.errors import ApiError
from mlxd.daemon.pipeline import Pipeline, Session
from mlxd.daemon.settings import Settings
from mlxd.protocol import openai as wire
from mlxd.protocol.messages import (
    AdmittedRequest,
    Constraint,
    Failed,
    Finished,
    LogprobPiece,
    MailboxEvent,
    Message,
    SamplingParams,
    TextDelta,
    Tool,
    ToolCall,
)
from quart import Response

ChoiceEvent = tuple[int, MailboxEvent]
# The app's model selection: a request's ``model`` → (the served id, the validator for it);
# raises the API's 404 (an unknown id) or 503 (not ready).
Select = Callable[[str | None], "tuple[str, Validator]"]


def check(ok: bool, param: str | None, message: str) -> None:
    if not ok:
        raise ApiError("invalid_request", message, param=param)


def json_response(obj: object, status: int = 200) -> Response:
    return Response(wire.encoder.encode(obj), status=status, content_type="application/json")


def decode(decoder: msgspec.json.Decoder, body: bytes, max_depth: int = 64):
    """The wire struct of a body that is UTF-8 and nested at most ``max_depth`` deep."""
    check(valid_utf8(body), None, "the request body is not valid UTF-8")
    check(
        json_depth(body, max_depth) <= max_depth,
        None,
        f"the JSON is nested deeper than {max_depth} levels (server.max_json_depth)",
    )
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise ApiError(
            "invalid_request", f"invalid request: {exc}", param=wire.error_param(exc)
        ) from exc
    except msgspec.DecodeError as exc:
        raise ApiError("invalid_request", f"invalid JSON: {exc}") from exc


# ---- validation -------------------------------------------------------------------------


SEED_MAX = 2**63 - 1
# JSON's numbers are doubles to most parsers; msgspec decodes an integer of any length. One
# beyond a double's range is refused as the float ``1e400`` is (the decoder's "Number out
# of range"), even where a large value is otherwise clamped.
NUMBER_MAX = sys.float_info.max
# Below this a temperature samples as greedy decoding does, and 1/T (the sampler scales the
# logits by it) could overflow: such a request is decoded greedily.
GREEDY_BELOW = 1e-5
PRIORITY_RANGE = (-(2**31), 2**31 - 1)
_FINITE = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def greedy_below(temperature: float) -> float:
    """A temperature in [0, ``GREEDY_BELOW``) is 0: greedy."""
    return 0.0 if 0.0 <= temperature < GREEDY_BELOW else temperature


class Validator:
    """Wire fields → internal structs, enforcing every limit in the settings.

    ``vocab_size`` says the loaded model's vocabulary size (None before it loads),
    for the checks on token ids and ``top_k``.
    """

    def __init__(self, settings: Settings, vocab_size: Callable[[], int | None] = lambda: None):
        self.engine = settings.engine
        self.model = settings.model
        self.tokenizer = settings.tokenizer
        self.max_messages = settings.tokenizer.max_messages
        self.max_json_depth = settings.server.max_json_depth
        self.max_body_bytes = settings.server.max_body_bytes
        self.retry_after_s = settings.admission.retry_after_s
        self.priority_enabled = settings.admission.priority
        self.vocab_size = vocab_size

    def decode(self, decoder: msgspec.json.Decoder, body: bytes):
        return decode(decoder, body, self.max_json_depth)

    def messages(self, count: int, param: str = "messages") -> None:
        check(
            count <= self.max_messages,
            param,
            f"at most {self.max_messages} messages per request (tokenizer.max_messages); "
            f"got {count}",
        )

    def priority(self, priority: int | None) -> int:
        """The request's priority when ``admission.priority`` is on; otherwise all are equal."""
        low, high = PRIORITY_RANGE
        check(
            priority is None or low <= priority <= high,
            "priority",
            "priority must be a 32-bit integer",
        )
        return (priority or 0) if self.priority_enabled else 0

    def for_model(self, vocab_size: int | None) -> Validator:
        """This validator for one model, whose vocabulary size is ``vocab_size`` (None:
        not known before it loads; the tokenizer and the engine check token ids then)."""
        bound = copy.copy(self)
        bound.vocab_size = lambda: vocab_size
        return bound

    def sampling(
        self,
        params: SamplingParams,
        *,
        max_tokens_param: str = "max_tokens",
        top_logprobs_param: str = "top_logprobs",
    ) -> SamplingParams:
        """Range checks on sampling options already taken from the wire (top_k -1 → 0, off;
        ``max_tokens`` above ``engine.max_tokens_cap`` clamped to it, or refused when
        ``engine.max_tokens_overflow = "refuse"``; a tiny temperature → 0, greedy)."""
        e = self.engine
        self.in_range(params.max_tokens, max_tokens_param)  # beyond a double: never clamped
        params = self.max_tokens(params, max_tokens_param)
        for name in _FINITE:
            check(math.isfinite(getattr(params, name)), name, f"{name} must be a finite number")
        check(0.0 <= params.temperature <= 2.0, "temperature", "temperature must be in [0, 2]")
        check(0.0 < params.top_p <= 1.0, "top_p", "top_p must be in (0, 1]")
        check(0.0 <= params.min_p <= 1.0, "min_p", "min_p must be in [0, 1]")
        check(-2.0 <= params.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        check(-2.0 <= params.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        check(0.0 < params.repetition_penalty <= 10.0, "repetition_penalty", "must be in (0, 10]")
        check(
            params.seed is None or 0 <= params.seed <= SEED_MAX,
            "seed",
            "seed must be an integer in [0, 2**63 - 1]",
        )
        check(
            0 <= params.top_logprobs <= e.max_top_logprobs,
            top_logprobs_param,
            f"{top_logprobs_param} must be between 0 and {e.max_top_logprobs} "
            "(engine.max_top_logprobs)",
        )
        return msgspec.structs.replace(
            params, top_k=self.top_k(params.top_k), temperature=greedy_below(params.temperature)
        )

    def max_tokens(self, params: SamplingParams, param: str) -> SamplingParams:
        """At least 1; above the cap, the cap (``clamp``) or a 400 (``refuse``). The
        tokenizer stage clamps it again to the context and memory left after the prompt."""
        e, asked = self.engine, params.max_tokens
        if asked is None or not e.max_tokens_cap or asked <= e.max_tokens_cap:  # 0: the context
            check(asked is None or asked >= 1, param, f"{param} must be at least 1")
            return params
        check(
            e.max_tokens_overflow == "clamp",
            param,
            f"{param} must be between 1 and {e.max_tokens_cap} (engine.max_tokens_cap; "
            'engine.max_tokens_overflow = "clamp" lowers it instead)',
        )
        return msgspec.structs.replace(params, max_tokens=e.max_tokens_cap)

    @staticmethod
    def in_range(value: int | None, param: str) -> None:
        """An integer field within a double's range (a 401-digit one is a 400, not clamped)."""
        check(
            value is None or -NUMBER_MAX <= value <= NUMBER_MAX,
            param,
            f"{param} is out of range (a number beyond what a double holds)",
        )

    def top_k(self, top_k: int) -> int:
        """0 (or -1, as vLLM spells it) is off; otherwise below the vocabulary size."""
        check(top_k >= -1, "top_k", "top_k must be >= 0 (0 or -1: off)")
        vocab = self.vocab_size()
        check(
            vocab is None or top_k < vocab,
            "top_k",
            f"top_k must be less than the vocabulary size ({vocab})",
        )
        return max(top_k, 0)

    def n(self, n: int) -> int:
        check(
            1 <= n <= self.engine.max_n,
            "n",
            f"n must be between 1 and {self.engine.max_n} (engine.max_n)",
        )
        return n

    def stops(self, stop: str | list[str] | None, param: str = "stop") -> tuple[str, ...]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        e = self.engine
        check(
            len(stops) <= e.max_stop_strings,
            param,
            f"at most {e.max_stop_strings} stop strings (engine.max_stop_strings)",
        )
        check(
            all(len(s) <= e.max_stop_length for s in stops),
            param,
            f"stop strings must be at most {e.max_stop_length} characters (engine.max_stop_length)",
        )
        return tuple(s for s in stops if s)

    def token_ids(self, ids: tuple[int, ...] | list[int], param: str) -> None:
        vocab = self.vocab_size()
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        check(not bad, param, f"token ids must be in [0, {vocab}): {bad[:5]}")

    def logit_bias(self, bias: dict[str, float] | None) -> dict[int, float]:
        """Token id → bias, clamped to [-100, 100] as OpenAI documents."""
        bias = bias or {}
        limit = self.engine.max_logit_bias
        check(
            len(bias) <= limit,
            "logit_bias",
            f"at most {limit} logit_bias entries (engine.max_logit_bias)",
        )
        check(
            all(k.isascii() and k.isdigit() for k in bias),
            "logit_bias",
            "logit_bias keys must be token ids (decimal integers)",
        )
        check(
            all(math.isfinite(v) for v in bias.values()),
            "logit_bias",
            "logit_bias values must be finite numbers",
        )
        out = {int(k): max(-100.0, min(100.0, v)) for k, v in bias.items()}
        self.token_ids(tuple(out), "logit_bias")
        return out

    def tools(self, tools: tuple[Tool, ...], param: str = "tools") -> tuple[Tool, ...]:
        """Named, unique, at most ``tokenizer.max_tools``, each within ``max_tool_chars``."""
        t = self.tokenizer
        check(
            len(tools) <= t.max_tools, param, f"at most {t.max_tools} tools (tokenizer.max_tools)"
        )
        for i, tool in enumerate(tools):
            schema = msgspec.json.encode(tool.parameters)
            check(
                max(len(tool.name), len(tool.description), len(schema)) <= t.max_tool_chars,
                f"{param}[{i}]",
                f"a tool's name, description and parameters (as JSON) must each be at most "
                f"{t.max_tool_chars} characters (tokenizer.max_tool_chars)",
            )
        return check_tools(tools, param)

    def arguments(self, arguments: str, param: str) -> None:
        """A tool call's ``arguments`` string, which the server parses as JSON later."""
        t = self.tokenizer
        check(
            len(arguments) <= t.max_tool_chars,
            param,
            f"tool-call arguments must be at most {t.max_tool_chars} characters "
            "(tokenizer.max_tool_chars)",
        )
        depth = json_depth(arguments.encode(), self.max_json_depth)
        check(
            depth <= self.max_json_depth,
            param,
            f"tool-call arguments are nested deeper than {self.max_json_depth} levels "
            "(server.max_json_depth)",
        )

    def history(self, messages: tuple[Message, ...], param: str, exact: bool = False) -> None:
        """Every earlier tool call's arguments; ``exact``: ``messages[i]`` is the wire's i."""
        limit = self.tokenizer.max_tool_chars
        for i, m in enumerate(messages):
            for j, call in enumerate(m.tool_calls):
                where = f"{param}[{i}].tool_calls[{j}]" if exact else param
                check(
                    max(len(call.name), len(call.id)) <= limit,
                    where,
                    f"a tool call's name and id must be at most {limit} characters "
                    "(tokenizer.max_tool_chars)",
                )
                self.arguments(call.arguments, f"{where}.function.arguments" if exact else param)


def no_chat_template(template: object) -> None:
    """A request may not set the chat template (every API): the server's is used."""
    check(
        template is None,
        "chat_template",
        "requests cannot set the chat template; the server's (model.chat_template) or the "
        "model's own is used",
    )


def json_constraint(kind: str, schema: dict | None, param: str) -> Constraint | None:
    """``text`` / ``json_object`` / ``json_schema`` → a constraint (None for plain text)."""
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(kind="json_object", param=param)
    check(kind == "json_schema", param, "type must be text, json_object or json_schema")
    check(isinstance(schema, dict), param, "json_schema needs a schema object")
    return Constraint(kind="json_schema", schema=schema, param=param)


def tool_choice(choice: str | None, tools: tuple[Tool, ...], named: str | None, param: str):
    """(choice for the template, forcing constraint or None) from a validated tool choice.

    ``required`` and a named tool are enforced at the token level: the output
    must be a well-formed call to an offered tool.
    """
    names = tuple(t.name for t in tools)
    if named is not None:
        check(named in names, param, f"tool_choice names '{named}', which is not in tools")
        return "required", Constraint(kind="tool_call", tool_names=(named,), param=param)
    choice = choice or "auto"
    check(choice in ("auto", "none", "required"), param, "must be auto, none, required or a tool")
    if choice == "required":
        check(bool(tools), param, "tool_choice 'required' needs tools")
        return choice, Constraint(kind="tool_call", tool_names=names, param=param)
    return choice, None


def strict_flag(
    name: str, parameters: dict | None, strict: bool | None, param: str, all_required: bool = True
) -> bool | None:
    """A tool's ``strict``; ``true`` needs a schema strict mode takes: every object sets
    ``additionalProperties: false`` and (OpenAI's rule, not Anthropic's) requires all its
    properties, at every level (else a 400 naming the rule and where, as OpenAI words it)."""
    if strict and parameters:
        problem = strict_schema_error(parameters, all_required)
        check(problem is None, param, f"Invalid schema for function '{name}': {problem}")
    return strict


def check_tools(tools: tuple[Tool, ...], param: str = "tools") -> tuple[Tool, ...]:
    names = [t.name for t in tools]
    check(all(names), param, "every tool needs a name")
    check(len(set(names)) == len(names), param, "tool names must be unique")
    return tools


def check_role(role: str, allowed: tuple[str, ...], param: str) -> None:
    """A message's role, one of ``allowed`` (a template given another may render nonsense)."""
    check(role in allowed, param, f"role must be one of {', '.join(allowed)}; got {role[:40]!r}")


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_THINKING_OFF = ("none", "minimal")


def reasoning_kwargs(effort: str | None, kwargs: dict, param: str) -> dict:
    """``kwargs`` with the template's ``enable_thinking`` set by a reasoning effort
    (``none`` / ``minimal``: off, the others: on; None: left to the template). An
    ``enable_thinking`` of ``chat_template_kwargs`` that disagrees is a 400."""
    if effort is None:
        return kwargs
    check(
        effort in REASONING_EFFORTS,
        param,
        f"{param} must be one of {', '.join(REASONING_EFFORTS)}; got {effort[:40]!r}",
    )
    thinking = effort not in _THINKING_OFF
    check(
        kwargs.get("enable_thinking", thinking) == thinking,
        param,
        f"{param} {effort!r} contradicts chat_template_kwargs.enable_thinking",
    )
    return {**kwargs, "enable_thinking": thinking}


def template_kwargs(kwargs: dict | None, param: str = "chat_template_kwargs") -> dict:
    kwargs = dict(kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    check(not clash, param, f"{', '.join(clash)} cannot be set through {param}")
    return kwargs


def both_constraints(a: Constraint | None, b: Constraint | None) -> Constraint | None:
    check(a is None or b is None, "response_format", "cannot be combined with a forced tool call")
    return a or b


# ---- running the request ------------------------------------------------------------------


async def _events(
    sessions: list[Session], bell: Bell, idle_s: float = 0.0
) -> AsyncIterator[list[ChoiceEvent]]:
    """The choices' events as they come, merged; every session closed at the end. An
    empty batch says nothing came for ``idle_s`` seconds (0: never), so a stream can send
    its keep-alive. Waiting here for the bell drops nothing: events stay in the sessions'
    mailboxes until a pass takes them."""
    done: set[int] = set()
    try:
        while len(done) < len(sessions):
            bell.reset()
            batch: list[ChoiceEvent] = []
            for i, session in enumerate(sessions):
                if i in done:
                    continue
                events = session.take()
                batch += [(i, e) for e in events]
                if events and isinstance(events[-1], Finished | Failed):
                    done.add(i)
                    await session.close()
            if batch:
                yield batch
                continue
            with trio.move_on_after(idle_s or math.inf) as quiet:
                await bell.wait()  # timeouts arrive as events (the pipeline's timer)
            if quiet.cancelled_caught:
                yield []
    finally:
        for session in sessions:
            await session.close()


def _check_speculation(pipeline: Pipeline, requests: list[AdmittedRequest], model: str) -> None:
    """A grammar matcher advances once per token and cannot be rolled back per row.

    A vision model's MTP runner decodes such requests in its plain lane: no refusal there.
    Before the model has loaded, its settings say whether it speculates.
    """
    info = pipeline.model_info(model)
    if info is not None and info.kind == "vision":
        return
    if model in pipeline.model_stats:
        spec = pipeline.model_stats[model].counters.speculative
        if spec is None or not spec.enabled:
            return
    elif not pipeline.speculative.get(model, False):
        return
    for r in requests:
        param = r.constraint.param if r.constraint else "logprobs"
        check(
            r.constraint is None and not r.sampling.logprobs,
            param,
            "structured output, forced tool calls and logprobs are not available while "
            "speculative decoding is on (speculative.enabled)",
        )


async def start(
    pipeline: Pipeline, requests: list[AdmittedRequest], model: str
) -> tuple[list[ChoiceEvent], AsyncIterator[list[ChoiceEvent]]]:
    """Submit the request's choices to ``model``; wait until each has begun (or failed:
    then raise).

    The returned iterator is started, so its cleanup (closing every session,
    which aborts unfinished sequences) runs even if the caller never reads it.
    """
    _check_speculation(pipeline, requests, model)
    requests = [msgspec.structs.replace(r, model=model) for r in requests]
    bell, sessions = Bell(), []
    try:
        for request in requests:
            sessions.append(await pipeline.submit(request, bell))
    except BaseException:
        for session in sessions:
            await session.close()
        raise
    events = _events(sessions, bell, pipeline.keepalive_s)
    first: list[ChoiceEvent] = []
    try:
        while {i for i, _ in first} != set(range(len(requests))):
            first += await anext(events)  # waits through queueing and tokenization
            failed = next((e for _, e in first if isinstance(e, Failed)), None)
            if failed is not None:
                raise ApiError.from_failed(failed)
    except BaseException:
        await events.aclose()
        raise
    return first, events


def merge_tool_calls(calls: list[ToolCall], delta: TextDelta) -> None:
    """Add a delta's tool-call pieces to ``calls``: a piece with an id opens a call, one
    without continues call ``index``'s arguments."""
    for c in delta.tool_calls:
        if c.id is not None:
            calls.append(ToolCall(id=c.id, name=c.name or "", arguments=c.arguments))
        else:
            last = calls[c.index]
            calls[c.index] = msgspec.structs.replace(last, arguments=last.arguments + c.arguments)


@dataclass
class Choice:
    """One choice's whole output, for non-streaming answers."""

    text: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[LogprobPiece] = field(default_factory=list)
    finished: Finished | None = None

    def add(self, delta: TextDelta) -> None:
        self.text += delta.text
        self.reasoning += delta.reasoning
        merge_tool_calls(self.calls, delta)
        self.logprobs += delta.logprobs


async def collect(
    n: int, first: list[ChoiceEvent], rest: AsyncIterator[list[ChoiceEvent]]
) -> list[Choice]:
    """Every choice to its end; an error in any is this request's error."""
    choices = [Choice() for _ in range(n)]
    batch: list[ChoiceEvent] | None = first
    try:
        while batch is not None:
            for i, event in batch:
                match event:
                    case TextDelta():
                        choices[i].add(event)
                    case Finished():
                        choices[i].finished = event
                    case Failed():
                        raise ApiError.from_failed(event)
            batch = await anext(rest, None)
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
    if any(c.finished is None for c in choices):
        raise ApiError("internal_error", "the request ended without a result")
    return choices


@dataclass(frozen=True)
class Usage:
    """A request's token counts, which each API renders into its own usage JSON.

    ``prompt`` is counted once however many choices ran; ``prefilled`` is set only
    when SpecPrefill skipped some of the prompt's uncached tokens.
    """

    prompt: int = 0
    completion: int = 0
    cached: int = 0
    prefilled: int | None = None

    @property
    def total(self) -> int:
        return self.prompt + self.completion

    @classmethod
    def of(cls, finished: Iterable[Finished | None]) -> Usage:
        done = [f for f in finished if f is not None]
        if not done:
            return cls()
        f = done[0]
        full = f.prompt_tokens - f.cached_tokens
        return cls(
            prompt=f.prompt_tokens,
            completion=sum(d.completion_tokens for d in done),
            cached=f.cached_tokens,
            prefilled=f.prefilled_tokens if 0 <= f.prefilled_tokens < full else None,
        )


def usage_of(choices: list[Choice]) -> Usage:
    return Usage.of(c.finished for c in choices)
