"""A model without a chat template gets its family's turn format, picked from its vocabulary.

mlxd's template for each family (``families/fallback_templates.py``) must render a
plain conversation as the family's real template does (llama.cpp's vendored
copies in ``.cache/templates``); the registry picks the family from the turn
tokens and says why; the loader installs it, ``/v1/status`` and ``mlxd parse``
show it; where no family matches the text is concatenated, with the warning;
``model.chat_template`` still wins. The Gemma 3 270M GGUF (no template) gets
Gemma's turn markers (``mlx`` tier).
"""

from __future__ import annotations

import io
import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlxd.actors.families import fallback_templates as ft
from mlxd.daemon import parse_cmd

from tests import templates

SYSTEM = {"role": "system", "content": "Be brief."}
PLAIN = [
    SYSTEM,
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Name a colour."},
]
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


def _reference(family: ft.TurnFormat, messages: list[dict], generation: bool) -> str:
    """The family's real template on ``messages``. Gemma 2's refuses a system message, which
    Gemma 3's template writes at the start of the first user turn: given to it that way."""
    if family.name == "gemma" and messages[0]["role"] == "system":
        first = {**messages[1], "content": messages[0]["content"] + "\n\n" + messages[1]["content"]}
        messages = [first, *messages[2:]]
    return templates.render(templates.source(family.reference), messages, generation, **SPECIAL)


@pytest.mark.parametrize("generation", [True, False])
@pytest.mark.parametrize("family", ft.FAMILIES, ids=lambda f: f.name)
def test_mlxds_template_renders_a_plain_conversation_as_the_familys_own(family, generation):
    mine = templates.render(family.template, PLAIN, generation, **SPECIAL)
    assert mine == _reference(family, PLAIN, generation)


@pytest.mark.parametrize("family", [f for f in ft.FAMILIES if f.name != "chatml"], ids=str)
def test_without_a_system_message_too(family):
    """(Qwen 2.5's template, ChatML's reference, adds a Qwen system prompt of its own.)"""
    mine = templates.render(family.template, PLAIN[1:], True, **SPECIAL)
    assert mine == _reference(family, PLAIN[1:], True)


@pytest.mark.parametrize(
    ("vocab", "family"),
    [
        ({"<bos>", "<start_of_turn>", "<end_of_turn>"}, "gemma"),
        ({"<|im_start|>", "<|im_end|>"}, "chatml"),
        ({"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}, "llama3"),
        ({"[INST]", "[/INST]"}, "mistral"),
        ({"<|user|>", "<|assistant|>", "<|end|>"}, "phi3"),
        # a DeepSeek distill keeps its base model's ChatML tokens: DeepSeek's turns win
        ({"<|im_start|>", "<|im_end|>", "<｜User｜>", "<｜Assistant｜>"}, "deepseek"),
    ],
)
def test_the_family_is_picked_from_the_turn_tokens(vocab, family):
    found = ft.pick(vocab)
    assert found is not None and found.name == family
    choice = ft.choose("", vocab)
    assert (choice.source, choice.family, choice.template) == ("family", family, found.template)
    assert found.tokens[0] in choice.why


def test_a_model_with_a_template_keeps_it_and_the_setting_wins():
    vocab = {"<start_of_turn>", "<end_of_turn>"}
    own = "{{ messages[0]['content'] }}"
    assert ft.choose(own, vocab) == ft.TemplateChoice("model", "the model's own chat template")
    assert ft.choose("", vocab, server_template=own).source == "setting"


def test_the_gguf_placeholder_counts_as_no_template():
    vocab = {"<|im_start|>", "<|im_end|>"}
    assert ft.choose(ft.concatenation(True), vocab).family == "chatml"


def test_no_family_concatenates_with_the_warning(caplog):
    tokenizer = SimpleNamespace(chat_template=None, add_bos_token=True, get_vocab=lambda: {"a": 0})
    with caplog.at_level(logging.WARNING, logger="mlxd"):
        choice = ft.settle(tokenizer)
    assert choice.source == "concatenation" and tokenizer.chat_template == ft.concatenation(True)
    assert "chat requests concatenate the messages' text" in caplog.text
    assert "model.chat_template" in caplog.text


def test_settle_installs_the_family_template_and_logs_why(caplog):
    tokenizer = SimpleNamespace(
        chat_template=ft.concatenation(False),
        get_vocab=lambda: {"<start_of_turn>": 1, "<end_of_turn>": 2},
    )
    processor = SimpleNamespace(chat_template=None)
    with caplog.at_level(logging.INFO, logger="mlxd"):
        choice = ft.settle(tokenizer, processor)
    gemma = ft.pick({"<start_of_turn>", "<end_of_turn>"})
    assert gemma is not None
    assert tokenizer.chat_template == processor.chat_template == gemma.template
    assert "gemma" in caplog.text and "<start_of_turn>" in caplog.text
    assert choice.status().family == "gemma"


def test_the_status_shows_the_choice_and_the_setting_over_it():
    from mlxd.actors.engine.scheduler.types import ModelInfo
    from mlxd.daemon.pipeline import _model_status

    chosen = ft.choose("", {"<|im_start|>", "<|im_end|>"}).status()
    info = ModelInfo(
        model_id="m",
        model_dir=Path("."),
        context_length=8,
        vocab_size=8,
        tokenizer=None,
        backend="cpu",
        chat_template=chosen,
    )
    assert _model_status("m", info).chat_template == chosen
    assert _model_status("m", info, server_template=True).chat_template.source == "setting"  # type: ignore[union-attr]


def _without_template(smollm_tokenizer: Path, out: Path) -> Path:
    """SmolLM2's tokenizer files (ChatML tokens) with the chat template taken out."""
    out.mkdir()
    for name in ("tokenizer.json", "special_tokens_map.json"):
        if (smollm_tokenizer / name).is_file():
            shutil.copy(smollm_tokenizer / name, out / name)
    config = json.loads((smollm_tokenizer / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_mlxd_parse_shows_the_picked_template(smollm_tokenizer, tmp_path, monkeypatch, capsys):
    model = _without_template(Path(smollm_tokenizer), tmp_path / "bare")
    monkeypatch.setattr("sys.stdin", io.StringIO("Blue."))
    args = SimpleNamespace(model=model, template=None, tools=None, prompt_opens_reasoning=False)
    assert parse_cmd.parse_command(args) == 0  # type: ignore[arg-type]
    report = json.loads(capsys.readouterr().out)
    assert report["chat_template"]["source"] == "family"
    assert report["chat_template"]["family"] == "chatml"
    assert "<|im_start|>" in report["chat_template"]["why"]
    assert report["content"] == "Blue."


@pytest.mark.mlx
def test_the_gemma_gguf_gets_gemmas_turn_markers(tmp_path_factory):
    from mlxd.actors.engine.loading.load import load_runner
    from mlxd.actors.tokenizer import PromptBuilder
    from mlxd.protocol.messages import ChatRequest, Message, SamplingParams
    from mlxd.scripts.gguf_sample import gemma3_270m

    cache = tmp_path_factory.mktemp("gemma-template")
    _, info = load_runner(str(gemma3_270m(cache)), cache, dequantize_on_cpu=True, max_batch=1)
    assert info.chat_template is not None
    assert (info.chat_template.source, info.chat_template.family) == ("family", "gemma")
    builder = PromptBuilder(info.tokenizer, 4096, default_max_tokens=8, vocab_size=info.vocab_size)
    request = ChatRequest(
        request_id="r",
        messages=(Message(role="system", content="Be brief."), Message(role="user", content="Hi")),
        sampling=SamplingParams(max_tokens=8),
    )
    text, tokens, _ = builder.render_chat(request, marks=False)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    turn = info.tokenizer.convert_tokens_to_ids("<start_of_turn>")
    assert tokens.count(turn) == 2  # each marker is its one special token


@pytest.mark.parametrize("server_template", ["", "{{ messages[0]['content'] }}"])
async def test_v1_status_shows_the_choice_and_the_setting_over_it(server_template):
    from mlxd.actors.engine.scheduler.types import ModelInfo
    from mlxd.daemon.app import create_app
    from mlxd.daemon.settings import load_settings

    from tests.conftest import running_graph
    from tests.fakes import CharTokenizer, FakeRunner

    chosen = ft.choose("", {"<start_of_turn>", "<end_of_turn>"}).status()
    runner = FakeRunner()

    def factory():
        info = ModelInfo(
            model_id="fake-model",
            model_dir=Path("."),
            context_length=4096,
            vocab_size=0x110000,
            tokenizer=CharTokenizer(),
            backend="fake",
            chat_template=chosen,
        )
        return runner, info

    overrides = {"model": {"chat_template": server_template}} if server_template else {}
    settings = load_settings(overrides=overrides)
    async with running_graph(settings, factory=factory) as (pipeline, _):
        client = create_app(pipeline, settings).test_client()
        body = json.loads(await (await client.get("/v1/status")).get_data())
    shown = body["model"]["chat_template"]
    assert body["models"][0]["model"]["chat_template"] == shown
    if server_template:
        assert shown == {"source": "setting", "why": "model.chat_template", "family": ""}
    else:
        assert (shown["source"], shown["family"]) == ("family", "gemma")
        assert "<start_of_turn>" in shown["why"]
