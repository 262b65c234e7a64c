"""The composite output parser: one per request, as its ``OutputSpec`` says.

Reasoning first (a tag pair at the start of the output), then the markup some
families wrap their answer in is dropped (Kimi K3's response section, Apriel's
final-response markers: ``reasoning.Tags.drop``), then tool calls in what
remains, in the format the model's family writes (``formats.py``). A format
whose parser reads reasoning itself (gpt-oss's harmony channels) gets the
whole output. Calls are numbered here; ``parallel_tool_calls: false`` keeps
the first. Pure Python: no trio, no mlx.
"""

from __future__ import annotations

import dataclasses

from mlxd.actors.families import reasoning
from mlxd.actors.families.formats import make_tool_parser
from mlxd.actors.parsers import (
    CallPiece,
    IdFactory,
    Parsed,
    ReasoningParser,
    new_call_id,
    partial_suffix,
)
from mlxd.protocol.messages import OutputSpec


class AnswerMarkup:
    """Drops ``markers`` wherever they occur in the content, and whitespace right after one."""

    def __init__(self, markers: tuple[str, ...]):
        self._markers = markers
        self._held = ""
        self._strip = False

    def feed(self, text: str) -> str:
        buffer, self._held, out = self._held + text, "", []
        while buffer:
            if self._strip:
                buffer = buffer.lstrip()
                self._strip = not buffer
            found = [(at, m) for m in self._markers if (at := buffer.find(m)) >= 0]
            if not found:
                keep = partial_suffix(buffer, self._markers)
                out.append(buffer[: len(buffer) - keep])
                self._held = buffer[len(buffer) - keep :]
                break
            at, marker = min(found)
            out.append(buffer[:at])
            buffer, self._strip = buffer[at + len(marker) :], True
        return "".join(out)

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class OutputParser:
    """Reasoning first, then tool calls in what remains; as one request's spec says."""

    def __init__(self, spec: OutputSpec, make_id: IdFactory = new_call_id):
        self._reasoning = (
            ReasoningParser(*spec.reasoning, inside=spec.in_reasoning) if spec.reasoning else None
        )
        drop = reasoning.of_pair(spec.reasoning).drop if spec.reasoning else ()
        self._answer = AnswerMarkup(drop) if drop else None
        self._tools = (
            make_tool_parser(spec.tool_format, make_id, spec.tools) if spec.tool_format else None
        )
        self._single = spec.single_tool_call
        self.calls = 0
        self.cut_call: int | None = None  # the call the token limit cut, if one was

    @property
    def active(self) -> bool:
        return self._reasoning is not None or self._tools is not None

    def feed(self, text: str) -> Parsed:
        stage = self._reasoning.feed(text) if self._reasoning else Parsed(content=text)
        return self._tool_stage(self._answer_stage(stage, final=False), final=False)

    def flush(self, cut: bool = False) -> Parsed:
        """The rest of the output; ``cut``: the token limit ended it, so a call it cut comes
        back incomplete (``cut.py``), never as markup in the content."""
        stage = self._reasoning.flush() if self._reasoning else Parsed()
        return self._tool_stage(self._answer_stage(stage, final=True), final=True, cut=cut)

    def _answer_stage(self, stage: Parsed, *, final: bool) -> Parsed:
        if self._answer is None:
            return stage
        stage.content = self._answer.feed(stage.content) if stage.content else ""
        if final:
            stage.content += self._answer.flush()
        return stage

    def _tool_stage(self, stage: Parsed, *, final: bool, cut: bool = False) -> Parsed:
        if self._tools is None:
            return stage
        out = Parsed(reasoning=stage.reasoning)
        out.extend(self._tools.feed(stage.content) if stage.content else Parsed())
        if final:
            out.extend(self._tools.flush(cut=cut))
        out.calls = [p for p in map(self._number, out.calls) if not (self._single and p.index)]
        for piece in out.calls:
            if piece.incomplete:
                self.cut_call = piece.index
        return out

    def _number(self, piece: CallPiece) -> CallPiece:
        """Index the piece: a first piece starts the next call, others continue the last."""
        if piece.id is not None:
            self.calls += 1
        return dataclasses.replace(piece, index=self.calls - 1)
