"""Fill-in-the-middle: the FIM formats mlxd lays out, and the one registry that picks one.

A code model trained for FIM reads the code before the cursor (the prefix) and after it
(the suffix) between special tokens of its own, in its family's order, and writes the
middle. Each entry names those tokens, the order (PSM: prefix, suffix, middle; SPM:
suffix first), the tokens that end the middle, and how other files of the repository
(llama.cpp's ``input_extra``) are laid out before it. ``detect`` picks the entry from
the vocabulary (and, for Granite, the chat template) and says why, for ``mlxd parse``,
``/v1/status`` and the log; a model whose vocabulary has none answers FIM requests with
a 400. Each token is looked up as one id of the vocabulary and written as that id; the
client's text is encoded with special tokens split, so code that spells a FIM token
stays text. Pure Python: no trio, no mlx.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mlxd.protocol.messages import FimInput

# One layout piece: a str is client text, an int a token id, ``MARK`` a prefix-cache
# checkpoint (where a hybrid model's state is worth a snapshot: it recurs as one types).
Piece = str | int | None
MARK = None


@dataclass(frozen=True)
class FimFormat:
    """One family's FIM tokens, order and repository layout."""

    name: str
    why: str
    prefix: str
    suffix: str
    middle: str  # "" where the family writes none (Codestral: the middle follows the prefix)
    order: Literal["psm", "spm"] = "psm"
    ends: tuple[str, ...] = ()  # tokens that end the middle (besides the model's EOS)
    repo_tokens: tuple[str, str] = ("", "")  # (repository name, file separator) tokens
    files: str = "plain"  # how other files are laid out: see ``_LAYOUTS``
    template: tuple[str, ...] = ()  # and all of these occur in the chat template
    requires: tuple[str, ...] = ()  # and these tokens are in the vocabulary too

    @property
    def tokens(self) -> tuple[str, ...]:
        """The tokens the vocabulary must hold, each as one id."""
        return tuple(t for t in (self.prefix, self.suffix, self.middle) if t)


FORMATS: tuple[FimFormat, ...] = (
    FimFormat(
        "qwen",
        "the vocabulary has <|fim_prefix|>, <|fim_suffix|> and <|fim_middle|>, with "
        "<|repo_name|> / <|file_sep|> for other files (Qwen2.5-Coder, Qwen3-Coder, Qwen3.5)",
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        ends=("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|im_end|>"),
        repo_tokens=("<|repo_name|>", "<|file_sep|>"),
        files="qwen",
        requires=("<|file_sep|>",),
    ),
    FimFormat(
        "codegemma",
        "the vocabulary has <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|> and "
        "<|file_separator|> (CodeGemma)",
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        ends=("<|file_separator|>", "<eos>", "<end_of_turn>"),
        requires=("<|file_separator|>",),
    ),
    FimFormat(
        "starcoder2",
        "the vocabulary has <fim_prefix>, <fim_suffix>, <fim_middle>, <repo_name> and "
        "<file_sep> (StarCoder2)",
        "<fim_prefix>",
        "<fim_suffix>",
        "<fim_middle>",
        ends=("<|endoftext|>", "<fim_pad>", "<file_sep>", "<repo_name>"),
        repo_tokens=("<repo_name>", "<file_sep>"),
        files="starcoder2",
        requires=("<repo_name>", "<file_sep>"),
    ),
    FimFormat(
        "granite",
        "the vocabulary has <fim_prefix>, <fim_suffix> and <fim_middle> and the template "
        "writes <|start_of_role|> (Granite 3.x)",
        "<fim_prefix>",
        "<fim_suffix>",
        "<fim_middle>",
        ends=("<|end_of_text|>", "<|endoftext|>", "<fim_pad>", "<filename>", "<reponame>"),
        repo_tokens=("<reponame>", "<filename>"),
        files="starcoder",
        template=("<|start_of_role|>",),
    ),
    FimFormat(
        "starcoder",
        "the vocabulary has <fim_prefix>, <fim_suffix> and <fim_middle> (StarCoder, "
        "Granite Code, SantaCoder)",
        "<fim_prefix>",
        "<fim_suffix>",
        "<fim_middle>",
        ends=("<|endoftext|>", "<fim_pad>", "<filename>", "<reponame>"),
        repo_tokens=("<reponame>", "<filename>"),
        files="starcoder",
    ),
    FimFormat(
        "deepseek",
        "the vocabulary has <｜fim▁begin｜>, <｜fim▁hole｜> and <｜fim▁end｜> "
        "(DeepSeek Coder, V2, V3, V4)",
        "<｜fim▁begin｜>",
        "<｜fim▁hole｜>",
        "<｜fim▁end｜>",
        ends=("<｜end▁of▁sentence｜>", "<|EOT|>"),
    ),
    FimFormat(
        "codestral",
        "the vocabulary has [SUFFIX] and [PREFIX]: suffix first, the middle follows the "
        "prefix (Codestral, Devstral)",
        "[PREFIX]",
        "[SUFFIX]",
        "",
        order="spm",
        ends=("</s>", "[MIDDLE]"),
    ),
)
BY_NAME = {f.name: f for f in FORMATS}
# Every token name an entry looks up: a builder keeps these ids, not the vocabulary.
NAMES = frozenset(
    name for f in FORMATS for name in (*f.tokens, *f.ends, *f.repo_tokens, *f.requires) if name
)


@dataclass(frozen=True)
class Detected:
    """The FIM format chosen for a model (None: it has none), and why."""

    format: FimFormat | None
    why: str


def detect(template: str, vocab: Collection[str]) -> Detected:
    """The model's FIM format: the first entry whose tokens (and the tokens it requires
    besides) are all in the vocabulary, and whose template markers, if it names any, are
    in the template. Qwen's vocabulary also holds CodeGemma's ``<|file_separator|>``: the
    entry that requires ``<|file_sep|>`` comes first."""
    for fmt in FORMATS:
        tokens = (*fmt.tokens, *fmt.requires)
        if all(t in vocab for t in tokens) and all(m in template for m in fmt.template):
            return Detected(fmt, f"vocabulary: {fmt.why}")
    return Detected(None, "the vocabulary has no fill-in-the-middle tokens of a known family")


# ---- laying out the prompt -------------------------------------------------------------------


def _with_newline(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"


def _plain(parts: FimInput, repo: int, sep: int) -> list[Piece]:
    """Families without repository tokens: the other files' text, as it is, first."""
    return [_with_newline(f.text) for f in parts.files]


def _files(parts: FimInput, sep: int) -> list[Piece]:
    out: list[Piece] = []
    for f in parts.files:
        out += [sep, f"{f.filename}\n{_with_newline(f.text)}"]
    return out


def _qwen(parts: FimInput, repo: int, sep: int) -> list[Piece]:
    """``<|repo_name|>NAME\\n``, ``<|file_sep|>PATH\\nTEXT`` per file, then the edited
    file's ``<|file_sep|>PATH\\n`` (Qwen2.5-Coder's repository-level layout)."""
    return [repo, f"{parts.repo}\n", *_files(parts, sep), sep, f"{parts.filename}\n"]


def _starcoder(parts: FimInput, repo: int, sep: int) -> list[Piece]:
    """``<reponame>NAME``, ``<filename>PATH\\nTEXT`` per file, then the edited file's
    ``<filename>PATH\\n`` (StarCoder's metadata tokens, which Granite's vocabulary keeps)."""
    return [repo, parts.repo, *_files(parts, sep), sep, f"{parts.filename}\n"]


def _starcoder2(parts: FimInput, repo: int, sep: int) -> list[Piece]:
    """``<repo_name>NAME``, ``<file_sep>PATH\\nTEXT`` per file, then ``<file_sep>``: the
    edited file's path opens its prefix, after ``<fim_prefix>`` (StarCoder2's layout)."""
    return [repo, parts.repo, *_files(parts, sep), sep]


_LAYOUTS: dict[str, Callable[[FimInput, int, int], list[Piece]]] = {
    "plain": _plain,
    "qwen": _qwen,
    "starcoder": _starcoder,
    "starcoder2": _starcoder2,
}


def pieces(fmt: FimFormat, parts: FimInput, ids: Mapping[str, int]) -> list[Piece]:
    """The prompt as client text and token ids, in the family's order. Other files come
    first (with the repository tokens where the vocabulary has them); without other
    files it is the family's single-file form."""
    repo, sep = (ids.get(t, -1) if t else -1 for t in fmt.repo_tokens)
    layout = fmt.files if repo >= 0 and sep >= 0 else "plain"
    head = _LAYOUTS[layout](parts, repo, sep) if parts.files else []
    prefix = parts.prefix
    if layout == "starcoder2" and parts.files:
        prefix = f"{parts.filename}\n{prefix}"
    # the lines before the cursor's line stay as one types on it: a checkpoint after them
    cut = prefix.rfind("\n") + 1
    pre = [ids[fmt.prefix], prefix[:cut], MARK, prefix[cut:]]
    suf = [ids[fmt.suffix], parts.suffix]
    body = pre + suf if fmt.order == "psm" else suf + pre
    middle = [ids[fmt.middle]] if fmt.middle else []
    return [*head, *body, *middle, MARK, parts.middle]


def end_ids(fmt: FimFormat, ids: Mapping[str, int]) -> tuple[int, ...]:
    """Tokens that end the middle: the family's ends and its own FIM tokens."""
    names = (*fmt.ends, *fmt.tokens, *(t for t in fmt.repo_tokens if t))
    return tuple(sorted({ids[t] for t in names if t in ids}))


class FimError(ValueError):
    """A FIM request this model cannot serve (it has no FIM tokens)."""


class FimBuilder:
    """One model's FIM layout: its format (or None), the ids of the FIM token names any
    entry uses (``NAMES``, a few dozen: the vocabulary itself is not kept), its leading
    specials."""

    def __init__(self, tokenizer: Any, template: str = "", vocab: Mapping[str, int] | None = None):
        self.tokenizer = tokenizer
        self.vocab = known_ids(vocab if vocab is not None else _vocab(tokenizer))
        found = detect(template, self.vocab)
        self.format, self.why = found.format, found.why
        self.lead = _leading_specials(tokenizer) if self.format else []

    def tokens(self, parts: FimInput) -> tuple[list[int], tuple[int, ...]]:
        """The prompt's token ids and its checkpoints; ``FimError`` for a model without
        FIM tokens."""
        if self.format is None:
            raise FimError(f"this model cannot fill in the middle: {self.why}")
        out, marks = list(self.lead), []
        for piece in pieces(self.format, parts, self.vocab):
            if piece is MARK:
                marks.append(len(out))
            else:
                out += [piece] if isinstance(piece, int) else self.encode(piece)
        return out, tuple(sorted({m for m in marks if 0 < m < len(out) - 1}))

    def encode(self, text: str) -> list[int]:
        """Client text as text: a FIM token spelled in the code is not that token."""
        if not text:
            return []
        try:
            return list(
                self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
            )
        except TypeError:  # a tokenizer without the option (no special tokens to split)
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    @property
    def ends(self) -> tuple[int, ...]:
        return end_ids(self.format, self.vocab) if self.format else ()


def known_ids(vocab: Mapping[str, int]) -> dict[str, int]:
    """The ids of the names in ``NAMES`` that ``vocab`` holds."""
    return {name: vocab[name] for name in NAMES if name in vocab}


def _vocab(tokenizer: Any) -> Mapping[str, int]:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    try:
        return get_vocab() if callable(get_vocab) else {}
    except (TypeError, ValueError, NotImplementedError):  # a tokenizer without a vocab dict
        return {}


def _leading_specials(tokenizer: Any) -> list[int]:
    """What the tokenizer puts before a prompt (a BOS), as a plain completion gets it."""
    try:
        with_specials: Sequence[int] = tokenizer.encode("a")
        bare: Sequence[int] = tokenizer.encode("a", add_special_tokens=False)
    except TypeError:
        return []
    ids, bare = list(with_specials), list(bare)
    for n in range(len(ids) - len(bare) + 1):
        if ids[n : n + len(bare)] == bare:
            return ids[:n]
    return []
