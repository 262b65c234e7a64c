"""GGUF → mlx-lm conversion, on the real SmolLM2-135M GGUF and on tiny synthetic inputs."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlxd.actors.engine.loading.gguf.convert import (
    UnsupportedModel,
    convert_gguf,
    default_model_path,
    permute_rows,
    unpermute_rows,
)

pytestmark = pytest.mark.mlx


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.fixture(scope="session")
def converted(cache_root: Path) -> Path:
    return convert_gguf(default_model_path(), cache_root, lambda _line: None)


@pytest.fixture(scope="session")
def loaded(converted: Path):
    from mlx_lm.utils import load

    return load(str(converted))


def test_converted_model_answers_paris(loaded) -> None:
    from mlx_lm import generate

    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    assert "Paris" in generate(model, tokenizer, prompt, max_tokens=20)


def test_second_conversion_reuses_directory(converted: Path, cache_root: Path) -> None:
    before = {p: p.stat().st_mtime_ns for p in [converted, *converted.iterdir()]}
    lines: list[str] = []
    again = convert_gguf(default_model_path(), cache_root, lines.append)
    assert again == converted
    assert {p: p.stat().st_mtime_ns for p in [again, *again.iterdir()]} == before
    assert not any(line.startswith("writing") for line in lines)
    # No leftover temporary siblings from either call.
    assert [p.name for p in cache_root.iterdir()] == [converted.name]


def test_tokenizer_splits_digits_and_renders_chatml(loaded) -> None:
    _, tokenizer = loaded
    assert len(tokenizer.encode("12345")) == 5
    text = "Hello world, how are you? ünïcødé 42"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user\nhi<|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(("n_heads", "cols"), [(4, 3), (2, 5)])
def test_unpermute_inverts_llama_cpp_permutation(n_heads: int, cols: int) -> None:
    rows = n_heads * 8
    w = mx.arange(rows * cols).reshape(rows, cols)
    permuted = permute_rows(w, n_heads)
    assert not mx.array_equal(permuted, w)
    assert mx.array_equal(unpermute_rows(permuted, n_heads), w)


def test_unpermute_matches_hf_rope_order() -> None:
    # One head of dim 4: llama.cpp stores rows (0, 2, 1, 3); HF wants (0, 1, 2, 3).
    stored = mx.array([0, 2, 1, 3])
    assert unpermute_rows(stored, 1).tolist() == [0, 1, 2, 3]


def test_other_architecture_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    mx.save_gguf(str(path), {"x": mx.zeros((2,))}, {"general.architecture": "mamba"})
    with pytest.raises(UnsupportedModel, match="'mamba' is not supported"):
        convert_gguf(path, tmp_path / "cache", lambda _line: None)
    assert not any((tmp_path / "cache").iterdir())


def test_a_file_without_vocabulary_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "novocab.gguf"
    mx.save_gguf(str(path), {"x": mx.zeros((2,))}, {"general.architecture": "llama"})
    with pytest.raises(UnsupportedModel, match="holds no vocabulary"):
        convert_gguf(path, tmp_path / "cache", lambda _line: None)
