"""Incremental detokenizer and stop strings, with a byte-level fake and the real tokenizer."""

import pytest
from mlxd.actors.detokenizer import IncrementalDetokenizer, StopMatcher


class ByteTokenizer:
    """One token per UTF-8 byte, decoded like HF byte-level BPE (invalid bytes → U+FFFD)."""

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def stream(detok, tokens, step=1):
    pieces = [detok.add(tokens[i : i + step]) for i in range(0, len(tokens), step)]
    return pieces + [detok.flush()]


@pytest.mark.parametrize(
    "text", ["héllo wörld", "emoji 🎉🚀 ok", "中文字符测试", "mixed 日本 👍🏽 end"]
)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_never_emits_partial_characters(text, step):
    tok = ByteTokenizer()
    pieces = stream(IncrementalDetokenizer(tok), tok.encode(text), step)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_emoji_is_held_until_complete():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    emoji = tok.encode("🎉")
    assert [detok.add([b]) for b in emoji] == ["", "", "", "🎉"]


def test_stop_string_split_across_tokens_is_never_shown():
    matcher = StopMatcher(["STOP"])
    shown = [matcher.feed(t) for t in ["hello S", "T", "OP and more"]]
    assert shown == ["hello ", "", ""]
    assert matcher.stopped


def test_partial_stop_prefix_released_when_it_diverges():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("a ST") == "a "
    assert matcher.feed("ART") == "START"
    assert not matcher.stopped
    assert matcher.feed("x ST") == "x "
    assert matcher.flush() == "ST"


def test_earliest_of_several_stops_wins():
    matcher = StopMatcher(["world", "lo"])
    assert matcher.feed("hello world") == "hel"


def test_no_stops_passes_through():
    matcher = StopMatcher([])
    assert matcher.feed("abc") == "abc"
    assert matcher.flush() == ""


class _ByteLevel:
    """Byte-level BPE in miniature: token 1 = "é" as its two bytes' stand-ins, 2 = first byte alone."""

    pieces = {1: "Ã©", 2: "Ã", 3: "<0xE2>"}

    def decode(self, ids, skip_special_tokens=True):
        raw = b"".join({1: b"\xc3\xa9", 2: b"\xc3", 3: b"\xe2"}[i] for i in ids)
        return raw.decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i] for i in ids]


def test_token_texts_give_exact_bytes_of_partial_characters():
    from mlxd.actors.detokenizer import TokenTexts

    texts = TokenTexts(_ByteLevel())
    assert texts(1) == ("é", (0xC3, 0xA9))
    assert texts(2) == ("\ufffd", (0xC3,))  # half a character: its real byte, not U+FFFD's
    assert texts(3) == ("\ufffd", (0xE2,))  # SentencePiece byte-fallback piece


def test_stop_matcher_names_the_stop_that_matched():
    m = StopMatcher(["zz", "b"])
    assert m.feed("aab") == "aa"
    assert m.matched == "b"
