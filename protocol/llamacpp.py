"""llama.cpp server wire format: ``/infill``, ``/tokenize`` and ``/detokenize``.

The shapes editor plugins (llama.vscode, Continue's llama.cpp provider, Tabby,
Twinny) send to llama.cpp's server. Unknown fields are ignored; a field of the
wrong type is a 400 naming its path. No trio, no mlx.
"""

from __future__ import annotations

from typing import Any

import msgspec


class ExtraChunk(msgspec.Struct, kw_only=True):
    """One ``input_extra`` entry: another file (or a chunk of one) of the repository."""

    text: str
    filename: str = ""


class InfillRequest(msgspec.Struct, kw_only=True):
    """``POST /infill``: the code around the cursor, other files, and the sampling fields
    it shares with llama.cpp's ``/completion``."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = []
    prompt: str = ""  # typed after the prefix: it follows the middle token
    model: str | None = None
    stream: bool = False
    n_predict: int | None = None  # -1: as many as fit
    max_tokens: int | None = None  # n_predict's OpenAI name
    n_indent: int = 0  # a new line indented less than this ends the middle
    t_max_predict_ms: int = 0  # after this long, the first new line ends the middle; 0: off
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1  # -1: random
    stop: list[str] = []
    n_probs: int = 0
    response_fields: list[str] | None = None


class Timings(msgspec.Struct, kw_only=True):
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    cache_n: int


class GenerationSettings(msgspec.Struct, kw_only=True):
    n_predict: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    stop: list[str]
    n_indent: int
    t_max_predict_ms: int
    model: str


class CompletionChunk(msgspec.Struct, kw_only=True):
    """A streamed chunk before the last: the new text, and no counts yet."""

    content: str
    stop: bool = False
    index: int = 0
    id_slot: int = 0
    tokens: list[int] = []


class Completion(msgspec.Struct, kw_only=True):
    """The whole answer, or a streamed chunk (then only ``content`` and ``stop`` until the last)."""

    content: str
    stop: bool
    index: int = 0
    id_slot: int = 0
    tokens: list[int] = []
    model: str | None = None
    tokens_predicted: int | None = None
    tokens_evaluated: int | None = None
    tokens_cached: int | None = None
    truncated: bool | None = None
    has_new_line: bool | None = None
    stop_type: str | None = None  # eos, limit, word; "abort": a newer request replaced it
    stopping_word: str | None = None
    generation_settings: GenerationSettings | None = None
    timings: Timings | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False
    model: str | None = None


class Piece(msgspec.Struct, kw_only=True):
    id: int
    piece: str | list[int]  # the bytes where they are no whole UTF-8 text


class TokenizeResponse(msgspec.Struct, kw_only=True):
    tokens: list[int] | list[Piece]


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int] = []
    model: str | None = None


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    content: str


class ErrorBody(msgspec.Struct, kw_only=True):
    code: int
    message: str
    type: str


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorBody


encoder = msgspec.json.Encoder()
infill_decoder = msgspec.json.Decoder(InfillRequest)
tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


def only_fields(body: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """llama.cpp's ``response_fields``: the named fields alone; ``a/b`` is ``body[a][b]``
    under the name ``b``; a missing one is left out."""
    out: dict[str, Any] = {}
    for name in fields:
        value: Any = body
        for part in name.split("/"):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            out[name.rpartition("/")[2]] = value
    return out
