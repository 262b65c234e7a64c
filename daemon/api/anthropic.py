"""Anthropic Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

Requests become the same ``ChatRequest`` as OpenAI chat (``tool_use`` blocks
→ assistant tool calls, ``tool_result`` blocks → ``tool`` turns, ``system`` →
the system turn), so the output is the same; it is shaped into content blocks
(``thinking``, ``text``, ``tool_use``) and, streaming, into Anthropic's exact
event sequence: ``message_start``, ``ping``, per block
``content_block_start`` / ``content_block_delta`` / ``content_block_stop``,
``message_delta`` (stop reason, cumulative usage), ``message_stop``.
``x-api-key``, ``anthropic-version`` and ``anthropic-beta`` headers are
accepted (mlxd has no keys). Errors use ``{"type": "error", "error": {"type", "message"}}``
(with ``details.error_code``, the reason's code, where it has one).

What Claude Code sends, and what each field does here:

- ``system`` blocks join into the system prompt, except a first line starting
  ``x-anthropic-billing-header:`` (a per-release tag that would defeat every
  prefix-cache hit), which is dropped. ``role: "system"`` turns before the first
  user or assistant turn join the system prompt too; later ones become user text
  wrapped in ``<system-reminder>`` where they stand (after the tool results of the
  next user turn, so a tool call and its result stay adjacent): templates accept
  that, and the system prompt, hence the cached prefix, stays put.
- ``cache_control`` on any block or tool marks a prefix-cache breakpoint
  (``ChatRequest.cache_breakpoints``: the message holding the block; the system
  message for ``system`` blocks and tools).
- ``thinking`` ``enabled`` / ``adaptive`` / ``disabled`` and ``output_config.effort``
  are one reasoning effort, which the model's family maps onto its template's
  variables (``low`` effort with adaptive thinking is ``minimal``: off where the template
  has only a switch); ``display: "omitted"`` returns thinking blocks with empty text. Every
  thinking block carries a signature (a digest of its text; mlxd checks none).
- ``output_config.format`` (``json_schema``) constrains the answer like OpenAI's
  ``response_format``; ``context_management`` edits: ``clear_thinking_*`` drops
  earlier thinking from the template's history (which otherwise gets it back),
  ``clear_tool_uses_*`` replaces old tool results as Anthropic documents
  (``edit_context``); other edit types, ``mcp_servers``, ``container``,
  ``chat_template`` and server tools are a 400.
- Tools with ``defer_loading`` stay out of the prompt; ``input_examples`` are
  appended to the description.
- The answer echoes the requested ``model``; tool-use ids are ``toolu_…``;
  ``usage.input_tokens`` counts the prompt tokens not read from the prefix cache,
  ``cache_read_input_tokens`` those read from it, ``cache_creation_input_tokens``
  is 0 (writing a snapshot costs nothing extra here). The fields the schema lists
  as required but nullable are always sent, in the shapes the official SDK
  declares: ``stop_details`` and ``container`` null (in ``message_delta``'s delta
  too), ``usage.cache_creation`` zeros, ``usage.service_tier`` ``standard``,
  ``usage.server_tool_use`` / ``inference_geo`` / ``output_tokens_details`` null,
  and ``caller: {"type": "direct"}`` on ``tool_use`` blocks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
import trio
from mlxd.actors.families.cut import close_json, complete_fields
from mlxd.actors.tokenizer import ModelUnavailable, PromptError
from mlxd.daemon.api import sse
from mlxd.daemon.api.common import (
    Choice,
    Select,
    Usage,
    Validator,
    check,
    collect,
    json_constraint,
    json_response,
    no_chat_template,
    start,
    strict_flag,
    tool_choice,
    usage_of,
)
from mlxd.daemon.api.errors import ApiError, ErrorFormat, ErrorReason, OnError, install_errors
from mlxd.daemon.pipeline import Pipeline
from mlxd.protocol import anthropic as wire
from mlxd.protocol.messages import (
    ChatRequest,
    Constraint,
    ContentPart,
    Finished,
    ImagePart,
    Message,
    SamplingParams,
    Started,
    TextDelta,
    TextPart,
    Tool,
    ToolCall,
)
from quart import Blueprint, Response, request
from quart_trio import QuartTrio

log = logging.getLogger("mlxd")

BILLING_HEADER = "x-anthropic-billing-header:"
# What a cleared tool result (context_management clear_tool_uses) reads.
CLEARED_RESULT = "[tool result cleared to save context]"
TRIGGER_TOKENS = 100_000  # clear_tool_uses' default trigger, as Anthropic's
KEEP_TOOL_USES = 3  # and its default number of latest tool uses kept

# Anthropic's error ``type`` per reason; the rest (timeouts, bugs) are ``api_error``.
_TYPES: dict[ErrorReason, str] = {
    **dict.fromkeys(
        (
            "invalid_request",
            "too_deeply_nested",
            "request_too_large",
            "bad_host",
            "method_not_allowed",
            "unsupported_media_type",
        ),
        "invalid_request_error",
    ),
    "invalid_api_key": "authentication_error",
    "host_not_allowed": "permission_error",
    "not_found": "not_found_error",
    "model_not_found": "not_found_error",
    "body_too_large": "request_too_large",
    "queue_full": "rate_limit_error",
    **dict.fromkeys(
        ("not_ready", "queue_timeout", "out_of_memory", "shutting_down", "model_loading"),
        "overloaded_error",
    ),
}


class AnthropicErrors(ErrorFormat):
    """``{"type": "error", "error": {"type", "message"}}``; the field at fault leads the
    message (Anthropic errors have no ``param``). A reason with a ``code`` (as OpenAI's
    ``error.code``: ``shutting_down``, ``queue_full``, ...) adds ``"details":
    {"error_code": code}``, which the official SDK reads as the exception's ``error_code``."""

    def error(self, error: ApiError) -> dict:
        message = f"{error.param}: {error}" if error.param else str(error)
        body: dict = {"type": self.type_of(error), "message": message}
        if error.code is not None:  # where the SDKs read a stable code (``error_code``)
            body["details"] = {"error_code": error.code}
        return {"type": "error", "error": body}

    def body(self, error: ApiError) -> bytes:
        return wire.encoder.encode(self.error(error))


ERRORS = AnthropicErrors(_TYPES, "api_error")


# ---- the conversation ----------------------------------------------------------------


def _result_part(x: wire.TextBlock | wire.ImageBlock) -> ContentPart:
    return TextPart(text=x.text) if isinstance(x, wire.TextBlock) else image_part(x)


def _tool_result(b: wire.ToolResultBlock) -> str | tuple[ContentPart, ...]:
    """The result's text; content parts when it holds images (a text model refuses those)."""
    prefix = "Error: " if b.is_error else ""
    if isinstance(b.content, str):
        return prefix + b.content
    parts = tuple(_result_part(x) for x in b.content)
    if all(isinstance(p, TextPart) for p in parts):
        return prefix + "\n".join(p.text for p in parts if isinstance(p, TextPart))
    return ((TextPart(text=prefix),) if prefix else ()) + parts


def image_part(block: wire.ImageBlock) -> ImagePart:
    """The image part the vision path reads (a text model refuses it)."""
    source = block.source
    if isinstance(source, wire.Base64Source):
        return ImagePart(url=f"data:{source.media_type};base64,{source.data}")
    return ImagePart(url=source.url)


def _marked(block: wire.Block) -> bool:
    """Whether a block (or, for a tool result, any block inside it) has ``cache_control``."""
    if block.cache_control is not None:
        return True
    inner = block.content if isinstance(block, wire.ToolResultBlock) else ""
    return not isinstance(inner, str) and any(x.cache_control is not None for x in inner)


def _without_billing(text: str) -> tuple[str, bool]:
    """``text`` less a first line holding Claude Code's billing header (and whether it had one)."""
    if not text.startswith(BILLING_HEADER):
        return text, False
    return text.partition("\n")[2], True


@dataclass
class Conversation:
    """The ``ChatRequest`` messages of a wire request, built turn by turn.

    ``breakpoints``: indices into ``messages`` whose message holds a ``cache_control``
    block; ``billing``: a billing-header line was dropped; ``reminders``: mid-conversation
    system text waiting for its place (after the next user turn's tool results).
    """

    messages: list[Message] = field(default_factory=list)
    breakpoints: set[int] = field(default_factory=set)
    billing: bool = False
    reminders: list[tuple[str, bool]] = field(default_factory=list)

    def add(self, message: Message, marked: bool = False) -> None:
        if marked:
            self.breakpoints.add(len(self.messages))
        self.messages.append(message)

    def system_text(self, content: str | list[wire.TextBlock]) -> tuple[str, bool]:
        """The text of system content (billing header dropped) and whether it is marked."""
        if isinstance(content, str):
            content = [wire.TextBlock(text=content)]
        texts = []
        for b in content:
            text, billing = _without_billing(b.text)
            self.billing |= billing
            if text or not billing:
                texts.append(text)
        return "\n".join(texts), any(b.cache_control is not None for b in content)

    def system(self, content: str | list[wire.Block], param: str) -> None:
        blocks = content if isinstance(content, str) else []
        if not isinstance(content, str):
            check(
                all(isinstance(b, wire.TextBlock) for b in content),
                param,
                "system turns hold text blocks only",
            )
            blocks = [b for b in content if isinstance(b, wire.TextBlock)]
        text, marked = self.system_text(blocks)
        if not text:
            return
        if any(m.role != "system" for m in self.messages):
            self.reminders.append((f"<system-reminder>\n{text}\n</system-reminder>", marked))
        else:
            self.add(Message(role="system", content=text), marked)

    def flush(self) -> None:
        """Place the waiting system reminders here, as user text."""
        for text, marked in self.reminders:
            self.add(Message(role="user", content=text), marked)
        self.reminders.clear()

    def user(self, content: list[wire.Block], param: str) -> None:
        """Tool results first (as ``tool`` turns), then the user's own text and images."""
        for b in content:
            if isinstance(b, wire.ToolResultBlock):
                message = Message(role="tool", tool_call_id=b.tool_use_id, content=_tool_result(b))
                self.add(message, _marked(b))
        self.flush()
        parts: list[ContentPart] = []
        for b in content:
            check(
                not isinstance(b, wire.ToolUseBlock), param, "tool_use belongs in assistant turns"
            )
            if isinstance(b, wire.TextBlock):
                parts.append(TextPart(text=b.text))
            elif isinstance(b, wire.ImageBlock):
                parts.append(image_part(b))
        own = [b for b in content if isinstance(b, wire.TextBlock | wire.ImageBlock)]
        if parts or not any(isinstance(b, wire.ToolResultBlock) for b in content):
            self.add(Message(role="user", content=tuple(parts)), any(map(_marked, own)))

    def assistant(self, content: list[wire.Block], param: str) -> None:
        """Text, tool calls and thinking (for the templates that render it back)."""
        check(
            not any(isinstance(b, wire.ToolResultBlock | wire.ImageBlock) for b in content),
            param,
            "assistant turns hold text, thinking and tool_use blocks only",
        )
        self.flush()
        text = "".join(b.text for b in content if isinstance(b, wire.TextBlock))
        calls = tuple(
            ToolCall(id=b.id, name=b.name, arguments=json.dumps(b.input, ensure_ascii=False))
            for b in content
            if isinstance(b, wire.ToolUseBlock)
        )
        thinking = "".join(b.thinking for b in content if isinstance(b, wire.ThinkingBlock))
        message = Message(
            role="assistant", content=text, tool_calls=calls, reasoning=thinking or None
        )
        self.add(message, any(map(_marked, content)))

    def turn(self, m: wire.InputMessage, param: str) -> None:
        if m.role == "system":
            self.system(m.content, param)
        elif isinstance(m.content, str):
            self.flush()
            self.add(Message(role=m.role, content=m.content))
        elif m.role == "user":
            self.user(m.content, param)
        else:
            self.assistant(m.content, param)


def conversation(w: wire.CountTokensRequest) -> Conversation:
    """The request's messages and cache breakpoints (tools' ``cache_control`` marks the
    system message: templates render tools there)."""
    c = Conversation()
    if w.system:
        text, marked = c.system_text(w.system)
        if text:
            c.add(Message(role="system", content=text), marked)
    for i, m in enumerate(w.messages):
        c.turn(m, f"messages[{i}]")
    c.flush()
    if any(t.cache_control is not None for t in w.tools or []) and c.messages:
        if c.messages[0].role == "system":
            c.breakpoints.add(0)
    return c


def messages_of(w: wire.CountTokensRequest) -> tuple[Message, ...]:
    return tuple(conversation(w).messages)


# ---- tools, thinking, output format ------------------------------------------------------


def _description(t: wire.ToolDef) -> str:
    if not t.input_examples:
        return t.description
    examples = "\n".join(json.dumps(x, ensure_ascii=False) for x in t.input_examples)
    return f"{t.description}\n\nInput examples:\n{examples}".lstrip()


def _tools(w: wire.CountTokensRequest, v: Validator):
    defs = w.tools or []
    for i, t in enumerate(defs):
        check(
            t.type in (None, "custom"),
            f"tools[{i}]",
            f"tool type {t.type!r} is an Anthropic server tool; mlxd runs custom tools only",
        )
    offered = [(i, t) for i, t in enumerate(defs) if not t.defer_loading]
    tools = v.tools(
        tuple(
            Tool(
                name=t.name,
                description=_description(t),
                parameters=t.input_schema,
                strict=strict_flag(
                    t.name, t.input_schema, t.strict, f"tools[{i}].input_schema", all_required=False
                ),
            )
            for i, t in offered
        )
    )
    c = w.tool_choice
    plain = None if c is None or c.type == "tool" else {"any": "required"}.get(c.type, c.type)
    if c is not None and c.type == "tool":
        check(c.name is not None, "tool_choice", "tool_choice type 'tool' needs a name")
    named = c.name if c is not None and c.type == "tool" else None
    choice, forced = tool_choice(plain, tools, named, "tool_choice")
    parallel = not (c is not None and c.disable_parallel_tool_use)
    return tools, choice, forced, parallel


def _thinking(w: wire.CountTokensRequest, max_tokens: int | None) -> dict:
    """``thinking`` and ``output_config.effort`` → the template's ``enable_thinking``.

    ``enabled`` / ``disabled`` decide; ``adaptive`` (or no ``thinking``) follows the
    effort as Responses' ``reasoning.effort`` does: ``low`` off, any other on; with
    neither, the template's default.
    """
    t = w.thinking
    effort = w.output_config.effort if w.output_config else None
    if t is not None and t.type == "enabled":
        budget = t.budget_tokens
        check(budget is not None and budget >= 1024, "thinking.budget_tokens", "must be >= 1024")
        check(
            max_tokens is None or budget < max_tokens,  # type: ignore[operator]
            "thinking.budget_tokens",
            "must be less than max_tokens",
        )
    if t is not None and t.type != "adaptive":
        return {"enable_thinking": t.type == "enabled"}
    if effort is not None:
        return {"enable_thinking": effort != "low"}
    return {} if t is None else {"enable_thinking": True}


def _effort(w: wire.CountTokensRequest) -> str | None:
    """``thinking`` and ``output_config.effort`` as the effort the model's family maps:
    ``disabled`` is none, ``enabled`` the effort (default high), ``adaptive`` or no
    ``thinking`` the effort with ``low`` as minimal (off where a template can only switch)."""
    t = w.thinking
    effort = w.output_config.effort if w.output_config else None
    if t is not None and t.type == "disabled":
        return "none"
    if t is not None and t.type == "enabled":
        return effort or "high"
    if effort is not None:
        return "minimal" if effort == "low" else effort
    return None if t is None else "medium"


def _constraint(w: wire.CountTokensRequest) -> Constraint | None:
    """``output_config.format`` (or the older ``output_format``): a JSON schema to follow."""
    fmt = w.output_config.format if w.output_config and w.output_config.format else None
    param = "output_config.format"
    if fmt is None and w.output_format is not None:
        fmt, param = w.output_format, "output_format"
    if fmt is None:
        return None
    check(fmt.type == "json_schema", param, "the only format type is json_schema")
    return json_constraint("json_schema", fmt.schema, param)


def _refusals(w: wire.CountTokensRequest) -> None:
    """Fields mlxd cannot honour: a 400 each, never silently ignored."""
    check(
        not w.mcp_servers,
        "mcp_servers",
        "mlxd cannot reach MCP servers; connect them in the client (as Claude Code does)",
    )
    check(w.container is None, "container", "mlxd runs no code-execution containers")
    no_chat_template(w.chat_template)


def context_edits(w: wire.CountTokensRequest) -> list[wire.ClearToolUses]:
    """The request's ``clear_tool_uses`` edits (``clear_thinking`` is applied where the
    conversation is built); any other edit type is a 400."""
    edits = w.context_management.edits if w.context_management else []
    out = []
    for i, raw in enumerate(edits):
        param = f"context_management.edits[{i}]"
        try:
            edit = msgspec.convert(raw, type=wire.ContextEdit)
        except msgspec.ValidationError as exc:
            raise ApiError(
                "invalid_request", f"unsupported context edit: {exc}", param=param
            ) from exc
        if isinstance(edit, wire.ClearToolUses):
            _check_clearing(edit, param)
            out.append(edit)
    return out


def _check_clearing(e: wire.ClearToolUses, param: str) -> None:
    for name, count, kinds in (
        ("trigger", e.trigger, ("input_tokens", "tool_uses")),
        ("keep", e.keep, ("tool_uses",)),
        ("clear_at_least", e.clear_at_least, ("input_tokens",)),
    ):
        if count is not None:
            check(count.type in kinds, f"{param}.{name}", f"type must be one of {list(kinds)}")
            check(count.value >= 0, f"{param}.{name}", "value must be >= 0")


def chat_request(
    w: wire.CountTokensRequest,
    rid: str,
    v: Validator,
    on_billing: Callable[[], None] = lambda: None,
) -> ChatRequest:
    """The request to run; ``on_billing`` is called when a billing-header line was dropped."""
    _refusals(w)
    context_edits(w)
    max_tokens = getattr(w, "max_tokens", None)
    tools, choice, forced, parallel = _tools(w, v)
    constraint = _constraint(w)
    check(
        constraint is None or forced is None,
        "output_config.format",
        "cannot be combined with a forced tool call",
    )
    sampling = SamplingParams()
    if isinstance(w, wire.MessagesRequest):
        sampling = v.sampling(
            SamplingParams(
                max_tokens=w.max_tokens,
                temperature=w.temperature,
                top_p=w.top_p,
                top_k=w.top_k,
                stop=v.stops(w.stop_sequences, "stop_sequences"),
            )
        )
    c = conversation(w)
    if c.billing:
        on_billing()
    messages = clear_thinking(tuple(c.messages), _thinking_edit(w))
    v.messages(len(messages))
    v.history(messages, "messages")
    return ChatRequest(
        request_id=rid,
        messages=messages,
        sampling=sampling,
        arrival=time.time(),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        constrain_calls=w.constrain_tool_calls,
        template_kwargs=_thinking(w, max_tokens),
        reasoning_effort=_effort(w),
        constraint=constraint or forced,
        cache_breakpoints=tuple(sorted(c.breakpoints)),
    )


# ---- context editing: clear_thinking, clear_tool_uses ------------------------------------


def _thinking_edit(w: wire.CountTokensRequest) -> wire.ClearThinking | None:
    edits = w.context_management.edits if w.context_management else []
    for raw in edits:
        if isinstance(raw, dict) and raw.get("type") == "clear_thinking_20251015":
            return msgspec.convert(raw, type=wire.ClearThinking)  # checked by context_edits
    return None


def clear_thinking(
    messages: tuple[Message, ...], edit: wire.ClearThinking | None
) -> tuple[Message, ...]:
    """Earlier thinking goes back to the template (as the turn's reasoning) unless a
    ``clear_thinking`` edit drops it: all but the last ``keep`` thinking turns (default 1,
    ``"all"`` keeps every one)."""
    if edit is None or edit.keep == "all":
        return messages
    keep = edit.keep.value if isinstance(edit.keep, wire.ThinkingTurns) else 1
    thinking = [i for i, m in enumerate(messages) if m.reasoning]
    dropped = set(thinking[: max(len(thinking) - keep, 0)])
    return tuple(
        msgspec.structs.replace(m, reasoning=None) if i in dropped else m
        for i, m in enumerate(messages)
    )


def _tool_names(messages: tuple[Message, ...]) -> dict[str, str]:
    return {c.id: c.name for m in messages for c in m.tool_calls}


def clear_tool_results(
    messages: tuple[Message, ...], edit: wire.ClearToolUses
) -> tuple[tuple[Message, ...], int]:
    """Every tool result but the latest ``keep`` (and those of ``exclude_tools``) replaced
    by a placeholder, with its call's input too under ``clear_tool_inputs``; and how many."""
    names = _tool_names(messages)
    results = [i for i, m in enumerate(messages) if m.role == "tool"]
    keep = edit.keep.value if edit.keep else KEEP_TOOL_USES
    old = results[: max(len(results) - keep, 0)]
    excluded = set(edit.exclude_tools or ())
    inputs = edit.clear_tool_inputs
    cleared: dict[str, bool] = {}  # call id → clear its input too
    out = list(messages)
    for i in old:
        m = messages[i]
        name = names.get(m.tool_call_id or "", "")
        if name in excluded or m.content == CLEARED_RESULT:
            continue
        out[i] = msgspec.structs.replace(m, content=CLEARED_RESULT)
        cleared[m.tool_call_id or ""] = inputs is True or (
            isinstance(inputs, list) and name in inputs
        )
    for i, m in enumerate(out):
        if any(cleared.get(c.id) for c in m.tool_calls):
            calls = tuple(
                msgspec.structs.replace(c, arguments="{}") if cleared.get(c.id) else c
                for c in m.tool_calls
            )
            out[i] = msgspec.structs.replace(m, tool_calls=calls)
    return tuple(out), len(cleared)


async def edit_context(
    req: ChatRequest,
    edits: list[wire.ClearToolUses],
    count: Callable[[ChatRequest], Awaitable[int]],
) -> tuple[ChatRequest, list[dict], int | None]:
    """Apply ``clear_tool_uses`` edits: (the request, the applied edits, the prompt tokens
    before any edit; None when nothing was counted). ``count`` renders and counts a request."""
    applied: list[dict] = []
    original: int | None = None
    for edit in edits:
        trigger = edit.trigger or wire.TokenCount(type="input_tokens", value=TRIGGER_TOKENS)
        uses = sum(m.role == "tool" for m in req.messages)
        if trigger.type == "tool_uses" and uses <= trigger.value:
            continue
        before = await count(req)
        original = before if original is None else original
        if trigger.type == "input_tokens" and before <= trigger.value:
            continue
        messages, n = clear_tool_results(req.messages, edit)
        if not n:
            continue
        edited = msgspec.structs.replace(req, messages=messages)
        after = await count(edited)
        least = edit.clear_at_least.value if edit.clear_at_least else 0
        if before - after < least:
            continue
        req = edited
        applied.append(
            {
                "type": "clear_tool_uses_20250919",
                "cleared_tool_uses": n,
                "cleared_input_tokens": before - after,
            }
        )
    return req, applied, original


# ---- the answer ------------------------------------------------------------------------------


def stop_reason(f: Finished) -> str:
    if f.finish_reason == "length":
        return "max_tokens"
    if f.finish_reason == "tool_calls":
        return "tool_use"
    return "stop_sequence" if f.stop_string is not None else "end_turn"


def _input(arguments: str, cut: bool = False) -> dict:
    """The call's arguments as an object (streamed arguments that went wrong: under ``_raw``;
    a call the token limit cut: the fields written whole)."""
    if cut:
        return complete_fields(arguments)
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"_raw": arguments}


def tool_use_id(call_id: str) -> str:
    """Anthropic's ``toolu_`` spelling of an mlxd call id (``call_<hex>``)."""
    return "toolu_" + call_id.removeprefix("call_")


def signature(thinking: str) -> str:
    """A thinking block's signature: opaque to clients, a digest of its text here."""
    return hashlib.sha256(thinking.encode()).hexdigest()


def usage(u: Usage) -> wire.Usage:
    """Anthropic's split: ``input_tokens`` + ``cache_read_input_tokens`` = the prompt."""
    return wire.Usage(
        input_tokens=u.prompt - u.cached,
        output_tokens=u.completion,
        cache_read_input_tokens=u.cached,
    )


def delta_usage(u: Usage) -> wire.DeltaUsage:
    """``message_delta``'s usage: the same counts, in its own (smaller) shape."""
    return wire.DeltaUsage(
        input_tokens=u.prompt - u.cached,
        output_tokens=u.completion,
        cache_read_input_tokens=u.cached,
    )


@dataclass(frozen=True)
class Shaping:
    """What the answer's shape depends on besides the output: the model id the client
    named, whether thinking text is shown, the applied context edits (None: none asked)."""

    model: str
    omit_thinking: bool = False
    edits: list[dict] | None = None

    def context_management(self) -> dict | None:
        return None if self.edits is None else {"applied_edits": self.edits}


def message_body(rid: str, shaping: Shaping, c: Choice) -> wire.Message:
    assert c.finished is not None
    content: list = []
    if c.reasoning:
        shown = "" if shaping.omit_thinking else c.reasoning
        content.append(wire.OutThinking(thinking=shown, signature=signature(c.reasoning)))
    if c.text:
        content.append(wire.OutText(text=c.text))
    f = c.finished
    content += [
        wire.OutToolUse(
            id=tool_use_id(t.id), name=t.name, input=_input(t.arguments, k == f.cut_call)
        )
        for k, t in enumerate(c.calls)
    ]
    return wire.Message(
        id=rid,
        type="message",
        role="assistant",
        model=shaping.model,
        content=content,
        stop_reason=stop_reason(f),
        stop_sequence=f.stop_string,
        stop_details=None,
        container=None,
        usage=usage(usage_of([c])),
        context_management=shaping.context_management(),
    )


def sse_event(kind: str, data: dict) -> bytes:
    return sse.frame(wire.encoder.encode(data), kind)


class MessageStream:
    """Anthropic stream events from mailbox events; one content block open at a time."""

    terminator = b""

    def __init__(self, rid: str, shaping: Shaping):
        self.rid, self.shaping = rid, shaping
        self.index = -1
        self.open: str | None = None  # kind of the open block
        self.thought = hashlib.sha256()  # the open thinking block's text so far
        self.arguments = ""  # the open tool_use block's partial JSON so far
        self.end: Finished | None = None

    def opening(self) -> list[bytes]:
        return []

    def started(self, i: int, started: Started) -> list[bytes]:
        u = Usage(prompt=started.prompt_tokens, cached=started.cached_tokens)
        message = wire.Message(
            id=self.rid,
            type="message",
            role="assistant",
            model=self.shaping.model,
            content=[],
            stop_reason=None,
            stop_sequence=None,
            stop_details=None,
            container=None,
            usage=usage(u),
        )
        return [
            sse_event("message_start", {"type": "message_start", "message": message}),
            sse_event("ping", {"type": "ping"}),
        ]

    def _block(self, kind: str, block: dict | wire.OutToolUse) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = kind
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return out + [sse_event("content_block_start", start)]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            sig = {"type": "signature_delta", "signature": self.thought.hexdigest()}
            out.append(self._delta(sig))
            self.thought = hashlib.sha256()
        self.open = None
        stop = {"type": "content_block_stop", "index": self.index}
        return out + [sse_event("content_block_stop", stop)]

    def _delta(self, delta: dict) -> bytes:
        body = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return sse_event("content_block_delta", body)

    def delta(self, i: int, event: TextDelta) -> list[bytes]:
        out: list[bytes] = []
        if event.reasoning:
            if self.open != "thinking":
                out += self._block(
                    "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                )
            self.thought.update(event.reasoning.encode())
            if not self.shaping.omit_thinking:
                out.append(self._delta({"type": "thinking_delta", "thinking": event.reasoning}))
        if event.text:
            if self.open != "text":
                out += self._block("text", {"type": "text", "text": "", "citations": None})
            out.append(self._delta({"type": "text_delta", "text": event.text}))
        for c in event.tool_calls:
            if c.id is not None:
                block = wire.OutToolUse(id=tool_use_id(c.id), name=c.name, input={})
                out += self._block("tool_use", block)
                self.arguments = ""
            if c.arguments:
                self.arguments += c.arguments
                out.append(self._delta({"type": "input_json_delta", "partial_json": c.arguments}))
        return out

    def finished(self, i: int, f: Finished) -> list[bytes]:
        self.end = f
        if f.cut_call is not None and self.open == "tool_use":
            # the limit cut the call: its partial JSON closed, so that the client can parse it
            if closing := close_json(self.arguments):
                out = [self._delta({"type": "input_json_delta", "partial_json": closing})]
                return out + self._close()
        return self._close()

    def closing(self, u: Usage) -> list[bytes]:
        assert self.end is not None
        delta = {
            "container": None,
            "stop_details": None,
            "stop_reason": stop_reason(self.end),
            "stop_sequence": self.end.stop_string,
        }
        body: dict = {"type": "message_delta", "delta": delta, "usage": delta_usage(u)}
        if self.shaping.edits is not None:
            body["context_management"] = self.shaping.context_management()
        return [
            sse_event("message_delta", body),
            sse_event("message_stop", {"type": "message_stop"}),
        ]

    def failed(self, error: ApiError) -> list[bytes]:
        return [sse_event("error", ERRORS.error(error))]

    def keepalive(self) -> list[bytes]:
        return [sse_event("ping", {"type": "ping"})]


class CountGate:
    """Bounds ``count_tokens``, which skips admission: ``tokenizer.workers`` requests read,
    decode and count at once, ``count_tokens_max_waiting`` more wait (their bodies unread),
    the rest get a 429."""

    def __init__(self, v: Validator):
        t = v.tokenizer
        self.slots = t.workers + t.count_tokens_max_waiting
        self.running = trio.CapacityLimiter(t.workers)
        self.retry_after_s = v.retry_after_s
        self.inside = 0

    @contextlib.asynccontextmanager
    async def enter(self) -> AsyncIterator[None]:
        if self.inside >= self.slots:
            raise ApiError(
                "queue_full",
                f"{self.inside} count_tokens requests are in progress or waiting "
                "(tokenizer.workers + tokenizer.count_tokens_max_waiting)",
                retry_after=self.retry_after_s,
            )
        self.inside += 1
        try:
            async with self.running:
                yield
        finally:
            self.inside -= 1


def install(
    app: QuartTrio, pipeline: Pipeline, v: Validator, select: Select, on_error: OnError
) -> None:
    """Register the Anthropic routes on the app, their errors in Anthropic's format."""
    api = Blueprint("anthropic", __name__)
    _routes(api, pipeline, v, select)
    install_errors(api, ERRORS, on_error, v.max_body_bytes)
    app.register_blueprint(api)


async def count_prompt(pipeline: Pipeline, req: ChatRequest) -> int:
    """The request's prompt tokens, its failures as this API's errors."""
    try:
        return await pipeline.count_tokens(req)
    except PromptError as exc:
        raise ApiError(exc.reason, str(exc), param=exc.param) from exc
    except ModelUnavailable as exc:
        f = exc.failed
        raise ApiError(f.reason, f.message, retry_after=f.retry_after) from exc


async def edited_request(
    w: wire.CountTokensRequest,
    req: ChatRequest,
    model: str,
    gate: CountGate,
    count: Callable[[ChatRequest], Awaitable[int]],
):
    """The request after its context edits, the edits applied (None: none asked) and the
    prompt tokens before them (None: not counted); counting goes through the count gate."""
    edits = context_edits(w)
    if w.context_management is None:
        return req, None, None
    if not edits:
        return req, [], None
    async with gate.enter():
        req = msgspec.structs.replace(req, model=model)
        return await edit_context(req, edits, count)


def _routes(app: Blueprint, pipeline: Pipeline, v: Validator, select: Select) -> None:
    gate = CountGate(v)
    billing_logged = False

    def billing() -> None:
        nonlocal billing_logged
        if not billing_logged:
            billing_logged = True
            log.debug("the x-anthropic-billing-header system line is dropped (logged once)")

    def build(w: wire.CountTokensRequest, rid: str, mv: Validator) -> ChatRequest:
        return chat_request(w, rid, mv, billing)

    async def count(req: ChatRequest) -> int:
        return await count_prompt(pipeline, req)

    async def edited(w: wire.CountTokensRequest, req: ChatRequest, model: str):
        return await edited_request(w, req, model, gate, count)

    @app.post("/v1/messages")
    async def messages() -> Response:
        w = v.decode(wire.messages_decoder, await request.get_data(cache=False))
        model, mv = select(w.model)
        rid = f"msg_{uuid.uuid4().hex}"
        req, applied, _ = await edited(w, build(w, rid, mv), model)
        omit = w.thinking is not None and w.thinking.display == "omitted"
        shaping = Shaping(model=w.model or model, omit_thinking=omit, edits=applied)
        first, rest = await start(pipeline, [req], model)
        if w.stream:
            return sse.stream(MessageStream(rid, shaping), first, rest)
        (choice,) = await collect(1, first, rest)
        return json_response(message_body(rid, shaping, choice))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens() -> Response:
        async with gate.enter():
            w = v.decode(wire.count_decoder, await request.get_data(cache=False))
            model, mv = select(w.model)
            req = build(w, f"count_{uuid.uuid4().hex}", mv)
            req = msgspec.structs.replace(req, model=model)
            edits = context_edits(w)
            req, _, original = await edit_context(req, edits, count)
            n = await count(req)
        body: dict = {"input_tokens": n}
        if w.context_management is not None:
            body["context_management"] = {"original_input_tokens": original or n}
        return json_response(body)
