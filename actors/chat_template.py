"""Rendering chat templates: transformers' renderer, and a fallback for templates it refuses.

transformers renders chat templates in Jinja's ``ImmutableSandboxedEnvironment``,
which refuses every call that mutates a list or dict. Some real templates
mutate lists they create themselves: Kimi K2's current templates queue call
ids with ``namespace(ids=[]).ids.append(...)``, so under transformers they fail
on any conversation with a tool call. For exactly that refusal mlxd renders the
template again in Jinja's (mutable) ``SandboxedEnvironment``, set up as
transformers sets up its own (``trim_blocks``, ``lstrip_blocks``, loop
controls, ``tojson``, ``raise_exception``, ``strftime_now``, the tokenizer's
special tokens as variables). The sandbox still refuses attribute access to
Python internals; templates come from the model or the operator, never from a
client, and mlxd passes the template copies of its own data.

The contract checked: transformers' ``apply_chat_template`` raises Jinja's
``SecurityError`` naming the refused method. Any other error is the template's
own and is raised as is.

The template's own defaults for reasoning: mlx-lm's tokenizer wrapper passes
``enable_thinking`` (its value: whether the vocabulary has ``<think>``) whenever
the caller passes nothing, so a template whose default is off (DeepSeek V3.1 /
V3.2 / V4) would open a ``<think>`` block no client asked for. Where the
template reads ``enable_thinking`` and the request sets no reasoning variable,
``render`` passes the value the template itself falls back to when the variable
is undefined, found once per template by rendering a probe conversation without
it and with each value (``thinking_default``). A template that tells "undefined"
apart from both values (MiniCPM 5: the model decides) cannot be given its
default through the wrapper; it gets the wrapper's. No trio, no mlx.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from mlxd.actors.families.reasoning import controls

# The mutating methods the immutable sandbox refuses and the mutable one allows.
_MUTATIONS = ("append", "extend", "insert", "pop", "remove", "update", "setdefault", "clear")


def refused_mutation(exc: BaseException) -> bool:
    """Whether ``exc`` is the immutable sandbox refusing a list or dict mutation."""
    text = str(exc)
    return isinstance(exc, jinja2.exceptions.SecurityError) and any(
        f"attribute '{name}'" in text for name in _MUTATIONS
    )


def _tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (transformers' assistant-mask tag) renders its
    body; mlxd asks for no assistant mask."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> jinja2.Template:
    env = jinja2.sandbox.SandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_Generation, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _now
    return env.from_string(source)


def _special_tokens(tokenizer: Any) -> dict[str, str]:
    tokens = getattr(tokenizer, "special_tokens_map", None) or {}
    return {k: v for k, v in tokens.items() if isinstance(v, str)}


# The switch mlx-lm's wrapper sets when the caller does not, and the variables that, when the
# request sets them, already say what the client asked for.
_WRAPPER_SWITCH = "enable_thinking"
_REASONING_VARIABLES = ("enable_thinking", "thinking")
_PROBE = [{"role": "user", "content": "Hi"}]


def _probe(source: str, variables: dict) -> str | None:
    try:
        return _compiled(source).render(
            messages=_PROBE, add_generation_prompt=True, bos_token="", eos_token="", **variables
        )
    except (jinja2.TemplateError, ValueError, TypeError, KeyError):
        return None  # a template that needs more than one user turn: no default known


@functools.lru_cache(maxsize=8)
def thinking_default(source: str) -> bool | None:
    """The value ``source`` gives ``enable_thinking`` when it is undefined: the one of
    True / False whose rendering matches the rendering without it. None where the template
    does not read it, tells undefined apart from both, or does not render the probe."""
    if _WRAPPER_SWITCH not in controls(source).switches:
        return None
    unset = _probe(source, {})
    matches = [v for v in (True, False) if _probe(source, {_WRAPPER_SWITCH: v}) == unset]
    return matches[0] if unset is not None and len(matches) == 1 else None


def _template_text(tokenizer: Any) -> str:
    source = getattr(tokenizer, "chat_template", None)
    return source if isinstance(source, str) else ""


def with_template_defaults(tokenizer: Any, extra: dict) -> dict:
    """``extra`` and, where it sets no reasoning variable, the template's own default for the
    switch mlx-lm's wrapper would otherwise set."""
    if any(name in extra for name in _REASONING_VARIABLES):
        return extra
    default = thinking_default(_template_text(tokenizer))
    return extra if default is None else {**extra, _WRAPPER_SWITCH: default}


def render(tokenizer: Any, messages: list[dict], generation_prompt: bool, **extra: Any) -> str:
    """The conversation rendered with the tokenizer's chat template (its own reasoning
    defaults kept where the request names no effort)."""
    extra = with_template_defaults(tokenizer, extra)
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False, **extra
        )
    except jinja2.exceptions.SecurityError as exc:
        source = getattr(tokenizer, "chat_template", None)
        if not refused_mutation(exc) or not isinstance(source, str):
            raise
        variables = {**_special_tokens(tokenizer), **extra}
        return _compiled(source).render(
            messages=messages, add_generation_prompt=generation_prompt, **variables
        )
