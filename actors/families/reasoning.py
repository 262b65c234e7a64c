"""Reasoning: the markup each family thinks in, and the template variables that switch it.

``detect_tags`` finds the tag pair a model's reasoning block opens and closes
with (``<think>``, Gemma 4's ``<|channel>thought``, Mistral's ``[THINK]`` ...),
from the template and else the vocabulary. gpt-oss thinks in harmony's
analysis channel instead, which its tool-call parser reads (``harmony.py``).

``controls`` reads which variables the template takes (``enable_thinking``,
``thinking``, ``reasoning_effort``) and maps the APIs' one reasoning effort
(chat ``reasoning_effort``, Responses ``reasoning.effort``, Anthropic
``thinking`` / ``output_config.effort``, Ollama ``think``) onto them. An effort
the model's template cannot express is refused (``EffortError``, a 400), never
silently dropped. Pure Python: no trio, no mlx.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import jinja2
import jinja2.meta

# The one vocabulary of efforts the APIs speak (Anthropic's ``max`` included).
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
OFF = ("none", "minimal")


@dataclass(frozen=True)
class Tags:
    """A reasoning block's tag pair, and the markup around the answer after it."""

    open: str
    close: str
    why: str
    # What identifies it in a template (all of these; default: the open tag). Templates that
    # build their tags from pieces (Kimi K3's ``'<|open|>' + tag``) name the pieces here.
    found_by: tuple[str, ...] = ()
    # Markup around the answer that is not content (Kimi K3's response wrapper, Apriel's
    # final-response markers, a bare close tag where the model skipped thinking): dropped.
    drop: tuple[str, ...] = ()

    def found_in(self, template: str) -> bool:
        return all(m in template for m in self.found_by or (self.open,))


# Tried in order; ``<think>`` last, since other markups may mention it in prose.
_TAGS = (
    Tags("<|channel>thought", "<channel|>", "Gemma 4's thought channel"),
    Tags("[THINK]", "[/THINK]", "Mistral's [THINK] block"),
    Tags("<seed:think>", "</seed:think>", "Seed-OSS's <seed:think> block"),
    # MiniMax-M3 writes a bare </mm:think> first where it does not think
    Tags("<mm:think>", "</mm:think>", "MiniMax-M3's <mm:think> block", drop=("</mm:think>",)),
    Tags(
        "<|START_THINKING|>",
        "<|END_THINKING|>",
        "Cohere's thinking block",
        drop=("<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TEXT|>", "<|END_TEXT|>"),
    ),
    Tags(
        "<|open|>think<|sep|>",
        "<|close|>think<|sep|>",
        "Kimi K3's think section, its answer in a response section",
        found_by=("'<|open|>'", "open_tag('think'"),
        drop=("<|open|>response<|sep|>", "<|close|>response<|sep|>", "<|close|>message<|sep|>"),
    ),
    Tags(
        "<think:opensource>",
        "</think:opensource>",
        "Tencent Hy3's <think:opensource> block",
        found_by=("'<think{}>'", "':opensource'"),
    ),
    Tags(
        "<|think|>",
        "<|end|>",
        "Solar Open's think message, its answer in a content message",
        found_by=("<|think|>", "<|begin|>assistant<|content|>"),
        drop=("<|begin|>assistant", "<|content|>"),
    ),
    Tags(
        "Here are my reasoning steps:",
        "[BEGIN FINAL RESPONSE]",
        "Apriel's reasoning steps before its final response",
        found_by=("[BEGIN FINAL RESPONSE]",),
        drop=("[BEGIN FINAL RESPONSE]", "[END FINAL RESPONSE]"),
    ),
    Tags("<|inner_prefix|>", "<|inner_suffix|>", "Apertus's inner deliberation block"),
    Tags("<think>", "</think>", "a <think> block"),
)


def detect_tags(template: str, vocab: Collection[str] = ()) -> tuple[Tags | None, str]:
    """The reasoning tags of a template (else of the vocabulary), and why."""
    for tags in _TAGS:
        if tags.found_in(template):
            return tags, f"template: {tags.why} ({tags.open} … {tags.close})"
    for tags in _TAGS:
        if tags.open in vocab and tags.close in vocab:
            return tags, f"vocabulary: {tags.why} ({tags.open} … {tags.close} are tokens)"
    return None, "neither the template nor the vocabulary has reasoning tags"


def of_pair(pair: tuple[str, str]) -> Tags:
    """The registry's entry for a tag pair (a pair the settings name: no answer markup)."""
    found = next((t for t in _TAGS if (t.open, t.close) == pair), None)
    return found or Tags(*pair, why="setting")


class EffortError(ValueError):
    """A reasoning effort this model's template cannot express (an HTTP 400)."""


# Families whose ``reasoning_effort`` takes a fixed set of values: template marker →
# {API effort: the template's value}. An effort missing from the map is refused.
_EFFORT_VALUES: tuple[tuple[str, dict[str, str]], ...] = (
    # gpt-oss: "Reasoning: low|medium|high" in its system message; it always reasons.
    # API "minimal" (Anthropic's adaptive thinking at low effort) is its lowest setting.
    ("<|channel|>", {"minimal": "low", "low": "low", "medium": "medium", "high": "high"}),
    # Tencent Hy3 raises on anything but no_think / low / high.
    (":opensource", {"none": "no_think", "low": "low", "high": "high"}),
    # DeepSeek V4 tells 'max' apart; any other effort is its default thinking.
    ("｜DSML｜tool_calls", {"low": "high", "medium": "high", "high": "high", "max": "max"}),
)


# Families' own variables that take a word per effort: variable → {API effort: its value}.
_MODES: tuple[tuple[str, dict[str, str]], ...] = (
    # MiniMax-M3: "disabled" opens the answer with </mm:think>, "enabled" with <mm:think>,
    # "adaptive" (its default) lets the model decide.
    (
        "thinking_mode",
        {"none": "disabled", "minimal": "disabled", "low": "adaptive"}
        | {e: "enabled" for e in ("medium", "high", "xhigh", "max")},
    ),
    # Kimi K3 raises on anything but low / high / max (read only while ``thinking``).
    (
        "thinking_effort",
        {"low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"},
    ),
)


@dataclass(frozen=True)
class Controls:
    """The reasoning variables a template reads, and how efforts map onto them."""

    switches: tuple[str, ...]  # boolean variables (enable_thinking, thinking)
    effort_var: bool  # the template reads reasoning_effort
    effort_values: dict[str, str] | None  # its accepted values (None: any effort as given)
    modes: tuple[tuple[str, dict[str, str]], ...] = ()  # variables of _MODES it reads

    @property
    def why(self) -> str:
        names = [*self.switches] + (["reasoning_effort"] if self.effort_var else [])
        names += [name for name, _ in self.modes]
        return ", ".join(names) if names else "none (the template has no reasoning switch)"

    def kwargs(self, effort: str) -> dict:
        """Template variables for ``effort``; raises ``EffortError`` where it cannot be said."""
        if effort not in EFFORTS:
            raise EffortError(f"unknown reasoning effort {effort!r}; known: {', '.join(EFFORTS)}")
        out: dict = {name: effort not in OFF for name in self.switches}
        out |= {name: values[effort] for name, values in self.modes if effort in values}
        if self.effort_var and self.effort_values is not None:
            value = self.effort_values.get(effort)
            if value is None and not (effort in OFF and self.switches):
                raise EffortError(
                    f"this model's template takes reasoning efforts "
                    f"{', '.join(self.effort_values)}; got {effort!r}"
                )
            if value is not None:
                out["reasoning_effort"] = value
        elif self.effort_var and not (effort in OFF and self.switches):
            out["reasoning_effort"] = effort
        return out  # a template without any switch: the model answers as it always does


_ENV = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])


def _variables(template: str) -> set[str]:
    try:
        return set(jinja2.meta.find_undeclared_variables(_ENV.parse(template)))
    except jinja2.TemplateError:  # a tag this plain parser lacks ({% generation %}): by name
        names = ("enable_thinking", "thinking", "reasoning_effort", *(m for m, _ in _MODES))
        return {n for n in names if n in template}


def controls(template: str) -> Controls:
    """The reasoning controls of a chat template."""
    found = _variables(template)
    switches = tuple(n for n in ("enable_thinking", "thinking") if n in found)
    effort_var = "reasoning_effort" in found
    values = next((v for marker, v in _EFFORT_VALUES if marker in template), None)
    modes = tuple(m for m in _MODES if m[0] in found)
    return Controls(switches, effort_var, values if effort_var else None, modes)
