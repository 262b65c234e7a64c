"""A GGUF as people have it: Gemma 3 270M Q4_K_M (PyPI chunks, ``scripts/install --test``).

Its tensors are F32, Q8_0, Q5_0, Q4_K and Q6_K; its architecture has sliding-window layers
(RotatingKVCache) between full-attention ones (KVCache), so a batch mixes both cache kinds.
It is a base model with no chat template.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import quants
from mlxd.actors.engine.loading.gguf.arch import ARCHITECTURES
from mlxd.actors.engine.loading.gguf.header import read_gguf
from mlxd.actors.engine.loading.gguf.tensors import dequantize
from mlxd.scripts.gguf_sample import gemma3_270m

from tests.engine_driver import alone, drive, request

pytestmark = pytest.mark.mlx


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(gguf path, runner, info), converted and loaded the way `mlxd serve FILE.gguf` does."""
    from mlxd.actors.engine.loading.load import load_runner

    cache = tmp_path_factory.mktemp("gemma-cache")
    path = gemma3_270m(cache)
    runner, info = load_runner(str(path), cache, dequantize_on_cpu=True, max_batch=8)
    return path, runner, info


def greedy(runner, tokens, max_tokens=8) -> list[int]:
    return alone(runner, [request("r", tokens, max_tokens)])["r"]


def test_the_assembled_file_is_found_again_without_rewriting(gemma) -> None:
    path, _, _ = gemma
    before = path.stat().st_mtime_ns
    assert gemma3_270m(path.parent) == path
    assert path.stat().st_mtime_ns == before
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_it_knows_the_capital_of_france(gemma) -> None:
    _, runner, info = gemma
    tok = info.tokenizer
    # This base model continues "The capital of France is" with " the capital of the country
    # of France ..."; " Paris" is among its first three choices there, and its greedy choice
    # one clause later.
    prompt = tok.encode("The capital of France is")
    logits = runner.model(mx.array([prompt]))[0, -1]
    top3 = mx.argsort(-logits)[:3].tolist()
    assert tok.encode(" Paris", add_special_tokens=False)[0] in top3
    text = tok.decode(greedy(runner, tok.encode("The capital of France is the city of")))
    assert "Paris" in text


def test_a_file_without_a_template_gets_its_familys_turn_format(gemma) -> None:
    """The file has no template (conversion writes the concatenation); the loader picks
    Gemma's from the vocabulary's turn tokens (tests/test_fallback_templates.py)."""
    from mlxd.actors.families.fallback_templates import CONCATENATION_MARK, pick

    _, _, info = gemma
    tok = info.tokenizer
    gemma_turns = pick(tok.get_vocab())
    assert gemma_turns is not None and tok.chat_template == gemma_turns.template
    saved = [info.model_dir / n for n in ("chat_template.jinja", "tokenizer_config.json")]
    assert any(CONCATENATION_MARK in p.read_text() for p in saved if p.is_file())
    chat = [{"role": "user", "content": "Hello"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n"
    )


def test_batch_mixing_rotating_and_full_caches_equals_alone(gemma) -> None:
    """Prompts of different lengths, joining at different steps, decode as they do alone.
    (A window that wraps mid-batch: test_gguf_synthetic, on a 4-token window.)"""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    _, runner, info = gemma
    kinds = {type(c) for c in runner.model.make_cache()}
    assert kinds == {KVCache, RotatingKVCache}
    encode = info.tokenizer.encode
    prompts = [
        "The capital of France is the city of",
        "Once upon a time, in a land far away, there lived a",
        "1, 2, 3,",
        "def fibonacci(n):",
    ]
    lengths = (5, 3, 6, 4)
    requests = [
        request(f"r{i}", encode(p), n)
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    expected = alone(runner, requests)
    schedule = {0: requests[:2], 1: requests[2:3], 2: requests[3:]}
    batched, failed = drive(runner, schedule)
    assert not failed
    assert batched == expected
    assert (runner.decoding, runner.prefilling_count, runner.cache_bytes) == (0, 0, 0)


def test_every_tensor_type_matches_the_gguf_reference(gemma) -> None:
    """One tensor of each type in the file: the served float32 weight is what
    ``gguf.quants.dequantize`` makes of the file's bytes (Gemma's norms less their +1)."""
    path, runner, info = gemma
    header = read_gguf(path)
    arch = ARCHITECTURES["gemma3"]
    params = dict(_flat(runner.model.parameters()))
    seen = {}  # the smallest tensor of each type
    for name, tensor in sorted(header.tensors.items(), key=lambda item: item[1].nbytes):
        seen.setdefault(tensor.type_name, (name, tensor))
    assert set(seen) == {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for type_name, (name, tensor) in seen.items():
        raw = data[tensor.offset : tensor.offset + tensor.nbytes].reshape(*tensor.shape[:-1], -1)
        reference = quants.dequantize(raw, tensor.ggml_type).reshape(tensor.shape)
        if name.endswith("norm.weight"):
            reference = reference - 1.0
        served = np.array(params[arch.mlx_name(name)])
        np.testing.assert_array_equal(served, reference.astype(np.float32), err_msg=type_name)


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flat(value, f"{prefix}{key}.")
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _flat(value, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def test_served_model_equals_the_llama_cpp_reference(gemma) -> None:
    """The whole stack: the numpy forward pass with llama.cpp's semantics on the GGUF tensors
    (test_gguf_synthetic.reference_logits: norms used as stored, NEOX RoPE, local and global
    layers) gives the served model's final hidden states, to float32 rounding. (Only the
    prompt's embedding rows are dequantized; the tied LM head is the tensor-type test's.)"""
    from types import SimpleNamespace

    from tests.test_gguf_synthetic import reference_logits

    path, runner, info = gemma
    header = read_gguf(path)
    tokens = info.tokenizer.encode("The capital of France is the city of")
    embedding = header.tensors.pop("token_embd.weight")
    truth = {name: dequantize(path, tensor) for name, tensor in header.tensors.items()}
    data = np.memmap(path, dtype=np.uint8, mode="r")[embedding.offset :][: embedding.nbytes]
    rows = np.zeros(embedding.shape, np.float32)  # untouched pages cost nothing
    rows[tokens] = quants.dequantize(
        data.reshape(embedding.shape[0], -1)[tokens], embedding.ggml_type
    )
    truth["token_embd.weight"] = rows
    file = SimpleNamespace(arch="gemma3", meta=header.metadata, truth=truth)
    want = reference_logits(file, tokens, head=False)
    got = np.array(runner.model.model(mx.array([tokens]))[0])
    assert np.abs(got - want).max() < 2e-3 * np.abs(want).max()
