"""A Hugging Face tokenizer from the vocabulary a GGUF file embeds.

The tokens, merges (BPE, ``tokenizer.ggml.model == "gpt2"``) or scores and token types
(SentencePiece, ``"llama"``) go through transformers' GGUF tokenizer builders
(``transformers.integrations.gguf``), which work offline from the metadata alone. The chat
template is ``tokenizer.chat_template``; a file without one gets ``FALLBACK_CHAT_TEMPLATE``,
which concatenates the messages' text, until the loader picks the family's turn format from
the vocabulary (``families/fallback_templates.py``; it warns where none matches).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxd.actors.engine.loading.gguf.arch import UnsupportedModel
from mlxd.actors.families.fallback_templates import CONCATENATION, concatenation

# Tokenizer attribute -> `tokenizer.ggml.` metadata key holding its id.
_SPECIAL_TOKEN_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
# End-of-generation ids the metadata names besides EOS.
_EOG_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id")
# Control tokens that end a turn, by text, as llama.cpp's vocabulary loader also treats them:
# chat files often name only EOS, while their template ends each turn with one of these.
_END_OF_TURN = frozenset({"<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>"})
_CONTROL = 3

# For a file without a template: the messages' text concatenated (mlxd's loader then picks the
# family's turn format from the vocabulary where it can: ``families/fallback_templates.py``).
FALLBACK_CHAT_TEMPLATE = CONCATENATION


def end_of_generation_ids(meta: dict[str, Any]) -> list[int]:
    """EOS, end-of-turn and end-of-message ids: from metadata, and control tokens by text."""
    ids = {meta[f"tokenizer.ggml.{k}"] for k in _EOG_KEYS if f"tokenizer.ggml.{k}" in meta}
    tokens = meta.get("tokenizer.ggml.tokens", [])
    types = meta.get("tokenizer.ggml.token_type") or [_CONTROL] * len(tokens)
    ids |= {
        i
        for i, (t, k) in enumerate(zip(tokens, types, strict=False))
        if t in _END_OF_TURN and k == _CONTROL
    }
    return sorted(ids)


def save_tokenizer(meta: dict[str, Any], out: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json for ``meta`` into ``out``."""
    # Imported here: transformers is slow to import and only needed on first conversion.
    from transformers import PreTrainedTokenizerFast

    tokens = meta["tokenizer.ggml.tokens"]
    special = {
        name: tokens[meta[f"tokenizer.ggml.{key}"]]
        for name, key in _SPECIAL_TOKEN_IDS.items()
        if f"tokenizer.ggml.{key}" in meta
    }
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    template = meta.get("tokenizer.chat_template")
    if not template:
        template = concatenation(add_bos)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_backend_tokenizer(meta),
        chat_template=template,
        add_bos_token=add_bos,
        **special,
    )
    tokenizer.save_pretrained(str(out))


def _backend_tokenizer(meta: dict[str, Any]) -> Any:
    """A `tokenizers.Tokenizer` from the vocabulary embedded in the metadata."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {
        name: meta[f"tokenizer.{key}"]
        for key, name in renames.items()
        if f"tokenizer.{key}" in meta
    }
    try:
        backend, _ = convert_gguf_tokenizer(meta["general.architecture"], tokenizer_dict)
    except ValueError as exc:  # an unknown tokenizer.ggml.model
        raise UnsupportedModel(f"GGUF tokenizer: {exc}") from exc
    pre = _PRE_TOKENIZERS.get(meta.get("tokenizer.ggml.pre", ""))
    if pre is not None:
        backend.pre_tokenizer = pre()
    return backend


def _smollm_pre_tokenizer() -> Any:
    # llama.cpp's `smollm` pre-tokenizer = SmolLM2's tokenizer.json: one token per digit.
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )


# llama.cpp pre-tokenizer names that transformers' GGUF converter does not know.
_PRE_TOKENIZERS: dict[str, Callable[[], Any]] = {"smollm": _smollm_pre_tokenizer}
