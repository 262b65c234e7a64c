"""Chat templates for models that carry none, picked from their vocabulary's turn markers.

Many GGUF files and older model directories ship no chat template. Their
vocabulary still names the family's turn markers as tokens (Gemma's
``<start_of_turn>``, ChatML's ``<|im_start|>``, Llama 3's ``<|start_header_id|>``
...), so mlxd can give the model the turn format it was trained on instead of
the concatenated text. Each entry is one family's turn format, written by mlxd
as a Jinja template that renders a plain conversation (system, user and
assistant turns, the generation prompt) as that family's own template does; the
entries are tried in order and the first whose tokens are all in the vocabulary
wins (DeepSeek's first: its distills keep their base model's ChatML or Llama 3
tokens too). ``choose`` says which template serves a model and why, for the
log, ``/v1/status`` and ``mlxd parse``; where no family matches, the messages'
text is concatenated (``CONCATENATION``) with a warning. The server's
``model.chat_template`` overrides all of it. Pure Python: no trio, no mlx.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from mlxd.protocol.status import ChatTemplateStatus

log = logging.getLogger("mlxd")


@dataclass(frozen=True)
class TurnFormat:
    """One family's turn format: the tokens that identify it and mlxd's template for it."""

    name: str
    why: str
    tokens: tuple[str, ...]  # all of these are tokens of the vocabulary
    template: str
    reference: str  # the real template (llama.cpp's collection) it renders as, for the tests


# Gemma 3: a system message opens the first user turn; the model's turns are "model".
_GEMMA = (
    "{{ bos_token }}"
    "{% set ns = namespace(prefix='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.prefix = ns.prefix + m['content'] + '\\n\\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' }}"
    "{{ ns.prefix + m['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{% set ns.prefix = '' %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

# ChatML: every message in its own <|im_start|>ROLE … <|im_end|> block, no default system.
_CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Llama 3.1+: a system header always, holding the knowledge and current dates, then the turns.
_LLAMA3 = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for m in messages if m['role'] == 'system' %}{% set ns.system = m['content'] | trim %}"
    "{% endfor %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{ 'Cutting Knowledge Date: December 2023\\nToday Date: ' }}"
    "{{ date_string if date_string is defined else '26 Jul 2024' }}{{ '\\n\\n' }}"
    "{{ ns.system + '<|eot_id|>' }}"
    "{% for m in messages if m['role'] != 'system' %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

# Mistral (v3 tokenizer, Nemo): [INST] … [/INST] turns, the system prompt joined to the
# last user turn, each answer closed by EOS.
_MISTRAL = (
    "{% set ns = namespace(system='', last=-1) %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% endif %}"
    "{% if m['role'] == 'user' %}{% set ns.last = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' and loop.index0 == ns.last and ns.system %}"
    "{{ '[INST]' + ns.system + '\\n\\n' + m['content'] + '[/INST]' }}"
    "{% elif m['role'] == 'user' %}{{ '[INST]' + m['content'] + '[/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)

# Phi-3 / 3.5: <|role|> … <|end|> blocks; without a generation prompt the text ends in EOS.
_PHI3 = (
    "{% for m in messages if m['content'] or m['role'] != 'system' %}"
    "{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)

# DeepSeek R1 (and its distills): the system prompt bare after BOS, <｜User｜> and
# <｜Assistant｜> turns (an answer's reasoning left out), the answer opening a think block.
_DEEPSEEK = (
    "{{ bos_token }}"
    "{% for m in messages if m['role'] == 'system' %}{{ m['content'] }}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + m['content'].split('</think>')[-1] + '<｜end▁of▁sentence｜>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
)

# Tried in order; the first whose tokens are all in the vocabulary is the model's.
FAMILIES: tuple[TurnFormat, ...] = (
    TurnFormat(
        "deepseek",
        "DeepSeek's <｜User｜> / <｜Assistant｜> turn tokens (R1 and its distills)",
        ("<｜User｜>", "<｜Assistant｜>"),
        _DEEPSEEK,
        "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    ),
    TurnFormat(
        "gemma",
        "Gemma's <start_of_turn> / <end_of_turn> turn tokens",
        ("<start_of_turn>", "<end_of_turn>"),
        _GEMMA,
        "google-gemma-2-2b-it",
    ),
    TurnFormat(
        "llama3",
        "Llama 3's <|start_header_id|> / <|end_header_id|> / <|eot_id|> header tokens",
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        _LLAMA3,
        "meta-llama-Llama-3.1-8B-Instruct",
    ),
    TurnFormat(
        "chatml",
        "ChatML's <|im_start|> / <|im_end|> tokens (Qwen, SmolLM, Hermes, ...)",
        ("<|im_start|>", "<|im_end|>"),
        _CHATML,
        "Qwen-Qwen2.5-7B-Instruct",
    ),
    TurnFormat(
        "phi3",
        "Phi-3's <|user|> / <|assistant|> / <|end|> tokens",
        ("<|user|>", "<|assistant|>", "<|end|>"),
        _PHI3,
        "microsoft-Phi-3.5-mini-instruct",
    ),
    TurnFormat(
        "mistral",
        "Mistral's [INST] / [/INST] control tokens",
        ("[INST]", "[/INST]"),
        _MISTRAL,
        "mistralai-Mistral-Nemo-Instruct-2407",
    ),
)

# For a model no family matches: the messages' text, one after another, separated by a blank
# line (text parts of a content list included), after BOS when ``add_bos``. No roles, and a
# generation prompt adds nothing: the model continues the text.
CONCATENATION_MARK = "mlxd: the GGUF file has no chat template"
CONCATENATION = (
    "{#- " + CONCATENATION_MARK + "; the messages' text is concatenated -#}"
    "{% if add_bos %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% if not loop.first %}{{ '\\n\\n' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endfor %}"
)


def concatenation(add_bos: bool) -> str:
    return CONCATENATION.replace("add_bos", "true" if add_bos else "false")


def pick(vocab: Collection[str]) -> TurnFormat | None:
    """The first family whose turn tokens are all in ``vocab``."""
    return next((f for f in FAMILIES if all(t in vocab for t in f.tokens)), None)


@dataclass(frozen=True)
class TemplateChoice:
    """Which chat template serves a model, and why. ``source``: ``model`` (its own),
    ``setting`` (``model.chat_template``), ``family`` (mlxd's, for ``family``) or
    ``concatenation`` (no template and no family: the messages' text)."""

    source: str
    why: str
    family: str = ""
    template: str = ""  # the template to install (family / concatenation); "": keep the model's

    def status(self) -> ChatTemplateStatus:
        return ChatTemplateStatus(source=self.source, why=self.why, family=self.family)


def has_template(template: str) -> bool:
    """Whether the model carries a template of its own (not none, not the concatenation)."""
    return bool(template.strip()) and CONCATENATION_MARK not in template


def choose(
    template: str, vocab: Collection[str], server_template: str = "", add_bos: bool = False
) -> TemplateChoice:
    """The chat template for a model whose own is ``template`` ("" where it has none)."""
    if server_template:
        return TemplateChoice("setting", "model.chat_template: the server's template")
    if has_template(template):
        return TemplateChoice("model", "the model's own chat template")
    found = pick(vocab)
    if found is not None:
        why = f"the model has no chat template; its vocabulary has {found.why}"
        return TemplateChoice("family", why, found.name, found.template)
    why = (
        "the model has no chat template and its vocabulary no family's turn tokens: "
        "chat requests concatenate the messages' text"
    )
    kept = template if template.strip() else concatenation(add_bos)
    return TemplateChoice("concatenation", why, template=kept)


def settle(tokenizer: Any, processor: Any = None) -> TemplateChoice:
    """Install the chosen template where the model has none (the tokenizer's, and the
    processor's where it has none either), log the choice, and return it. The server's
    template is installed later, over this one (``tokenizer.use_chat_template``)."""
    from mlxd.actors.tools import template_source, vocabulary

    add_bos = bool(getattr(tokenizer, "add_bos_token", False))
    choice = choose(template_source(tokenizer), vocabulary(tokenizer), add_bos=add_bos)
    if choice.template and choice.template != template_source(tokenizer):
        tokenizer.chat_template = choice.template
        if processor is not None and not getattr(processor, "chat_template", None):
            processor.chat_template = choice.template
    if choice.source == "family":
        log.info("chat template: mlxd's %s template (%s)", choice.family, choice.why)
    elif choice.source == "concatenation":
        log.warning("%s (set model.chat_template for a real one)", choice.why)
    return choice
