"""A Responses answer's output items, built from one request's events.

``OutputBuilder`` is the one place that turns ``TextDelta`` / ``Finished``
into output items (``reasoning``, ``message``, ``function_call``,
``custom_tool_call``) and the stream events that go with them; a streaming
answer sends the events, a non-streaming one keeps only the items. One item is
open at a time: reasoning, text and calls arrive in order, and a new kind of
output closes the open item. The item open when ``max_output_tokens`` ends the
answer is ``incomplete`` (a call only if the limit cut it: ``Finished.cut_call``);
every earlier one is ``completed``. Plain Python: no
trio, no HTTP.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

import msgspec
from mlxd.daemon.api.reasoning_seal import ReasoningSeal
from mlxd.protocol import responses as wire
from mlxd.protocol.messages import Finished, LogprobPiece, TextDelta, ToolCallDelta

Event = tuple[str, dict]  # (event type, its fields but ``type`` and ``sequence_number``)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Target:
    """What a name the model calls stands for: a function (maybe of a namespace) or a
    custom tool."""

    name: str
    namespace: str | None = None
    custom: bool = False


@dataclass(frozen=True)
class OutputOptions:
    """How the request wants its items.

    ``targets``: offered tool name → what it stands for (a name not there is a plain
    function). ``summary``: the reasoning text goes in ``summary`` (there is no
    summarizer) rather than ``content``. ``seal``: signs reasoning into
    ``encrypted_content`` (None: not included). ``max_tool_calls``: later calls are
    dropped.
    """

    targets: dict[str, Target] = field(default_factory=dict)
    summary: bool = False
    seal: ReasoningSeal | None = None
    logprobs: bool = False
    max_tool_calls: int | None = None


def custom_input(arguments: str) -> str | None:
    """A custom tool's input from the arguments of the function the model called: the
    ``input`` string (or the one string value) of the JSON object; None if there is none."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("input"), str):
        return value["input"]
    strings = [v for v in value.values() if isinstance(v, str)]
    return strings[0] if len(value) == 1 and strings else None


def logprobs_json(pieces: list[LogprobPiece] | tuple[LogprobPiece, ...]) -> list[dict]:
    return [
        {
            "token": p.token,
            "logprob": p.logprob,
            "bytes": list(p.bytes),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)} for t, b, lp in p.top],
        }
        for p in pieces
    ]


@dataclass
class _Open:
    """The item being built: its id, its kind and the text it has so far."""

    item_id: str
    kind: str  # reasoning | message | call
    text: str = ""
    logprobs: list[dict] = field(default_factory=list)
    call_id: str = ""
    name: str = ""  # the name the model called (calls)
    index: int = -1  # the call's index among the request's calls


class OutputBuilder:
    """Output items and their stream events; ``output`` holds the finished items."""

    def __init__(self, options: OutputOptions):
        self.o = options
        self.output: list[wire.OutputItem] = []
        self.open: _Open | None = None
        self.end: Finished | None = None
        self.reasoning_tokens = 0
        self.dropped: set[int] = set()  # calls past max_tool_calls

    # ---- events in ----------------------------------------------------------------

    def delta(self, event: TextDelta) -> list[Event]:
        out: list[Event] = []
        if event.reasoning:
            out += self._reasoning(event.reasoning)
            if not event.text and not event.tool_calls:
                self.reasoning_tokens += event.tokens
        if event.text:
            out += self._text(event.text, event.logprobs)
        for call in event.tool_calls:
            out += self._call(call)
        return out

    def finish(self, event: Finished) -> list[Event]:
        self.end = event
        incomplete = event.finish_reason == "length"
        if self._is("call") and self.open.index != event.cut_call:  # type: ignore[union-attr]
            incomplete = False  # a whole call: the limit cut nothing of it
        if self.open is None and not self.output:  # nothing at all: one empty message
            return self._start(_Open(new_id("msg"), "message")) + self._close(incomplete)
        return self._close(incomplete)

    # ---- opening and growing items --------------------------------------------------

    def _where(self) -> dict:
        assert self.open is not None
        return {"item_id": self.open.item_id, "output_index": len(self.output)}

    def _start(self, item: _Open) -> list[Event]:
        out = self._close(False)
        self.open = item
        item_added = {"output_index": len(self.output), "item": self._item("in_progress")}
        added = ("response.output_item.added", item_added)
        if item.kind == "message":
            part = wire.OutputText(text="")
            return out + [added, ("response.content_part.added", self._part(part))]
        if item.kind == "reasoning" and self.o.summary:
            part = wire.SummaryText(text="")
            data = {**self._where(), "summary_index": 0, "part": part}
            return out + [added, ("response.reasoning_summary_part.added", data)]
        return out + [added]

    def _part(self, part: object) -> dict:
        return {**self._where(), "content_index": 0, "part": part}

    def _reasoning(self, text: str) -> list[Event]:
        out = [] if self._is("reasoning") else self._start(_Open(new_id("rs"), "reasoning"))
        assert self.open is not None
        self.open.text += text
        if self.o.summary:
            data = {**self._where(), "summary_index": 0, "delta": text}
            return out + [("response.reasoning_summary_text.delta", data)]
        data = {**self._where(), "content_index": 0, "delta": text}
        return out + [("response.reasoning_text.delta", data)]

    def _text(self, text: str, pieces: tuple[LogprobPiece, ...]) -> list[Event]:
        out = [] if self._is("message") else self._start(_Open(new_id("msg"), "message"))
        assert self.open is not None
        self.open.text += text
        logprobs = logprobs_json(pieces) if self.o.logprobs else []
        self.open.logprobs += logprobs
        data = {**self._where(), "content_index": 0, "delta": text, "logprobs": logprobs}
        return out + [("response.output_text.delta", data)]

    def _call(self, c: ToolCallDelta) -> list[Event]:
        limit = self.o.max_tool_calls
        if c.id is not None and limit is not None and c.index >= limit:
            self.dropped.add(c.index)
        if c.index in self.dropped:
            return []
        out: list[Event] = []
        if c.id is not None:
            item = _Open(new_id("fc"), "call", call_id=c.id, name=c.name or "", index=c.index)
            if self._target(item.name).custom:
                item.item_id = new_id("ctc")
            out += self._start(item)
        if self.open is None or self.open.kind != "call" or self.open.index != c.index:
            return out  # more of a call that is no longer open: cannot happen in order
        self.open.text += c.arguments
        if c.arguments and not self._target(self.open.name).custom:
            data = {**self._where(), "delta": c.arguments}
            out.append(("response.function_call_arguments.delta", data))
        return out

    def _is(self, kind: str) -> bool:
        return self.open is not None and self.open.kind == kind

    def _target(self, name: str) -> Target:
        return self.o.targets.get(name) or Target(name)

    # ---- closing items ----------------------------------------------------------------

    def _close(self, incomplete: bool) -> list[Event]:
        if self.open is None:
            return []
        status = "incomplete" if incomplete else "completed"
        item, where, out = self._item(status), self._where(), []
        match item:
            case wire.OutReasoning() if self.o.summary:
                text = {**where, "summary_index": 0, "text": self.open.text}
                part = {**where, "summary_index": 0, "part": wire.SummaryText(text=self.open.text)}
                out += [
                    ("response.reasoning_summary_text.done", text),
                    ("response.reasoning_summary_part.done", part),
                ]
            case wire.OutReasoning():
                text = {**where, "content_index": 0, "text": self.open.text}
                out.append(("response.reasoning_text.done", text))
            case wire.OutMessage():
                done = {**where, "content_index": 0, "text": self.open.text}
                out.append(("response.output_text.done", {**done, "logprobs": self.open.logprobs}))
                out.append(("response.content_part.done", self._part(item.content[0])))
            case wire.OutFunctionCall():
                args = {**where, "name": item.name, "arguments": item.arguments}
                out.append(("response.function_call_arguments.done", args))
            case wire.OutCustomToolCall():
                if item.input:
                    delta = {**where, "delta": item.input}
                    out.append(("response.custom_tool_call_input.delta", delta))
                out.append(("response.custom_tool_call_input.done", {**where, "input": item.input}))
        out.append(("response.output_item.done", {"output_index": len(self.output), "item": item}))
        self.output.append(item)
        self.open = None
        return out

    def _item(self, status: str) -> wire.OutputItem:
        """The open item as the wire shows it, with ``status``."""
        o = self.open
        assert o is not None
        done = status != "in_progress"
        if o.kind == "reasoning":
            return self._reasoning_item(o, status)
        if o.kind == "message":
            content = [wire.OutputText(text=o.text, logprobs=o.logprobs)] if done else []
            return wire.OutMessage(id=o.item_id, status=status, content=content)
        target = self._target(o.name)
        if target.custom:
            value = custom_input(o.text) if done else ""
            return wire.OutCustomToolCall(
                id=o.item_id,
                call_id=o.call_id,
                name=target.name,
                input=o.text if value is None else value,
                status=status,
            )
        return wire.OutFunctionCall(
            id=o.item_id,
            call_id=o.call_id,
            name=target.name,
            namespace=target.namespace,
            arguments=o.text if done else "",
            status=status,
        )

    def _reasoning_item(self, o: _Open, status: str) -> wire.OutReasoning:
        item = wire.OutReasoning(id=o.item_id, status=status)
        if status == "in_progress" or not o.text:
            return item
        if self.o.summary:
            item.summary = [wire.SummaryText(text=o.text)]
        else:
            item.content = [wire.ReasoningText(text=o.text)]
        if self.o.seal is not None:
            item.encrypted_content = self.o.seal.seal(o.text)
        return item


def history_of(output: list[wire.OutputItem]) -> list[dict]:
    """Output items as the input items a later request sends back."""
    return [msgspec.to_builtins(item) for item in output]
