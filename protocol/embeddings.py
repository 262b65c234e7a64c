"""Embeddings: what an embedding model is (``EmbeddingInfo``) and OpenAI's
``/v1/embeddings`` wire types. Nothing here imports trio or mlx.

The internal messages (``EmbedRequest``, ``Embed``, ``Embedded``) live with the other
actor messages in ``protocol/messages.py``.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

POOLINGS = ("mean", "cls", "last")


class EmbeddingInfo(msgspec.Struct, frozen=True, kw_only=True):
    """An embedding model's traits, known once it has loaded.

    ``dimensions``: the native size of its vectors; ``pooling``: how a sequence's hidden
    states become one vector (``mean`` over its tokens, the first (``cls``) or the
    ``last`` token's); ``normalize``: vectors are L2-normalised; ``matryoshka``: the
    sizes the model declares it was trained to be truncated to (empty: none, and a
    request's ``dimensions`` must then be the native size); ``max_tokens``: the longest
    input, in tokens; ``backend``: the library whose model body runs it.
    """

    dimensions: int
    pooling: Literal["mean", "cls", "last"]
    normalize: bool = True
    matryoshka: tuple[int, ...] = ()
    max_tokens: int
    backend: str = "mlx-lm"


# ---- OpenAI wire ------------------------------------------------------------------------


class EmbeddingsRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/embeddings``. ``input``: a string, a list of strings, a list of token
    ids or a list of such lists (checked by the handler: msgspec cannot tell list
    types apart in a union). ``user`` is accepted and has no effect on the answer."""

    input: str | list[Any]
    model: str | None = None
    dimensions: int | None = None
    encoding_format: str = "float"
    user: str | None = None


class EmbeddingItem(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str  # base64 of little-endian float32 for encoding_format=base64
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct, kw_only=True):
    data: list[EmbeddingItem]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


embeddings_decoder = msgspec.json.Decoder(EmbeddingsRequest)
