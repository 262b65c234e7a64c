"""With no effort in the request, the chat template's own reasoning default decides.

mlx-lm's tokenizer wrapper passes ``enable_thinking`` (True where the vocabulary
has ``<think>``) whenever the caller passes nothing. DeepSeek V3.1's template
defaults to thinking off and Qwen3's to on, so through the wrapper alone a V3.1
prompt ends in ``<think>`` and a Qwen3 prompt (vocabulary without ``<think>``)
ends in an empty think block. Each real template here is rendered behind the
real wrapper, with and without ``<think>`` in the vocabulary, and must give
what plain Jinja gives without the variable; an effort turns thinking on or off.
"""

from __future__ import annotations

import pytest
from mlxd.actors import chat_template
from mlxd.protocol.messages import ChatRequest, Message, SamplingParams

from tests import templates

V31, QWEN3 = "deepseek-ai-DeepSeek-V3.1", "Qwen-Qwen3-0.6B"
HI = [{"role": "user", "content": "Hi"}]


def wrapped(template: str, think_tokens: bool):
    """A word-level tokenizer wearing ``template``, behind mlx-lm's ``TokenizerWrapper``."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "Hi"] + (["<think>", "</think>"] if think_tokens else [])
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=template, bos_token="<s>", eos_token="</s>"
    )
    return TokenizerWrapper(hf)


def _builder(name: str, think_tokens: bool):
    from mlxd.actors.tokenizer import PromptBuilder

    tokenizer = wrapped(templates.source(name), think_tokens)
    return PromptBuilder(tokenizer, 8192, default_max_tokens=16, vocab_size=len(tokenizer))


def _chat(effort: str | None) -> ChatRequest:
    return ChatRequest(
        request_id="r",
        messages=(Message(role="user", content="Hi"),),
        sampling=SamplingParams(max_tokens=8),
        reasoning_effort=effort,
    )


@pytest.mark.parametrize("think_tokens", [True, False])
@pytest.mark.parametrize("name", [V31, QWEN3])
def test_no_effort_renders_the_templates_own_default(name, think_tokens):
    source = templates.source(name)
    expected = templates.render(source, HI, True, bos_token="<s>")
    text, _, _ = _builder(name, think_tokens).render_chat(_chat(None), marks=False)
    assert text == expected


def test_the_wrapper_alone_would_open_thinking_deepseek_left_off():
    """The fault this guards against: the wrapper's own default, on the same tokenizer."""
    tokenizer = wrapped(templates.source(V31), think_tokens=True)
    assert tokenizer.apply_chat_template(HI, add_generation_prompt=True, tokenize=False).endswith(
        "<think>"
    )
    assert chat_template.render(tokenizer, HI, True).endswith("<think></think>")


def test_the_wrapper_alone_would_close_thinking_qwen3_leaves_on():
    tokenizer = wrapped(templates.source(QWEN3), think_tokens=False)
    forced = tokenizer.apply_chat_template(HI, add_generation_prompt=True, tokenize=False)
    assert forced.endswith("<think>\n\n</think>\n\n")
    assert chat_template.render(tokenizer, HI, True).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("think_tokens", [True, False])
def test_an_effort_switches_thinking_as_asked(think_tokens):
    v31, qwen3 = _builder(V31, think_tokens), _builder(QWEN3, think_tokens)
    assert v31.render_chat(_chat("high"), marks=False)[0].endswith("<｜Assistant｜><think>")
    assert v31.render_chat(_chat("none"), marks=False)[0].endswith("<think></think>")
    assert qwen3.render_chat(_chat("high"), marks=False)[0].endswith("<|im_start|>assistant\n")
    assert qwen3.render_chat(_chat("none"), marks=False)[0].endswith("<think>\n\n</think>\n\n")


def test_template_kwargs_from_the_client_win():
    tokenizer = wrapped(templates.source(V31), think_tokens=False)
    text = chat_template.render(tokenizer, HI, True, thinking=True)
    assert text.endswith("<think>")


@pytest.mark.parametrize(
    ("name", "default"),
    [
        (V31, False),
        ("deepseek-ai-DeepSeek-V4", False),
        (QWEN3, True),
        ("google-gemma-4-31B-it", False),
        ("GLM-4.7-Flash", True),
        # undefined is a third state (the model decides): no boolean says it
        ("openbmb-MiniCPM5-1B", None),
        # reads no enable_thinking of the caller's (its own namespace variable)
        ("NVIDIA-Nemotron-Nano-v2", None),
    ],
)
def test_the_default_is_read_from_the_template(name, default):
    assert chat_template.thinking_default(templates.source(name)) is default
