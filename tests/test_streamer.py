"""The streamer's sync core: parsers, special marker tokens and logprob pieces per request."""

from __future__ import annotations

from dataclasses import dataclass

from mlxd.actors.mailbox import Mailboxes
from mlxd.actors.streamer import StreamState
from mlxd.protocol.messages import (
    EngineStep,
    Failed,
    Finished,
    OutputSpec,
    Started,
    TextDelta,
    TokenLogprob,
    TokenStep,
)


@dataclass
class Added:
    content: str
    special: bool


class SpecialTokenizer:
    """Characters are their code points; ids 1 and 2 are special tokens, as in Mistral's."""

    added_tokens_decoder = {1: Added("[TOOL_CALLS]", True), 2: Added("<s>", True)}

    def decode(self, ids, skip_special_tokens=True):
        specials = {i: a.content for i, a in self.added_tokens_decoder.items()}
        return "".join(
            "" if (i in specials and skip_special_tokens) else specials.get(i, chr(i)) for i in ids
        )


def run(spec: OutputSpec, tokens: list[int], logprobs: bool = False):
    boxes = Mailboxes()
    box = boxes.register("r")
    state = StreamState(SpecialTokenizer(), boxes)
    state.on_step(EngineStep(started=(Started(request_id="r", prompt_tokens=3, output=spec),)))
    for i, t in enumerate(tokens):
        last = i == len(tokens) - 1
        lp = (TokenLogprob(token=t, logprob=-1.0, top=((t, -1.0), (65, -2.0))),) if logprobs else ()
        step = TokenStep(
            request_id="r", tokens=(t,), finish_reason="length" if last else None, logprobs=lp
        )
        state.on_step(EngineStep(tokens=(step,)))
    events = box.take()
    assert len(state) == 0
    return [e for e in events if isinstance(e, TextDelta)], events[-1]


def codes(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_special_marker_reaches_the_parser_other_specials_stay_hidden():
    tokens = [2, *codes("ok"), 1, *codes('[{"name": "f", "arguments": {"a": 1}}]')]
    (delta,), finished = run(OutputSpec(tool_format="mistral"), tokens)
    assert delta.text == "ok"  # "<s>" hidden
    # The text before the marker is content; the calls come whole at the end.
    assert [c.name for c in delta.tool_calls] == ["f"]
    assert isinstance(finished, Finished) and finished.finish_reason == "length"


def test_without_a_parser_special_tokens_are_hidden():
    (delta,), _ = run(OutputSpec(), [2, *codes("hi"), 1])
    assert delta.text == "hi" and delta.tool_calls == ()


def test_logprob_pieces_follow_their_tokens():
    (delta,), _ = run(OutputSpec(), codes("hey"), logprobs=True)
    assert [p.token for p in delta.logprobs] == ["h", "e", "y"]
    assert delta.logprobs[0].top == (("h", (104,), -1.0), ("A", (65,), -2.0))


def test_a_stop_string_ends_the_request_and_asks_for_its_abort_once():
    boxes = Mailboxes()
    box = boxes.register("r")
    state = StreamState(SpecialTokenizer(), boxes)
    spec = OutputSpec(stop=("cd",))  # stop strings come with the OutputSpec, in Started
    state.on_step(EngineStep(started=(Started(request_id="r", prompt_tokens=3, output=spec),)))
    step = TokenStep(request_id="r", tokens=tuple(codes("abcdef")))
    assert state.on_step(EngineStep(tokens=(step,))) == ["r"]  # the streamer aborts it
    assert box.engine_done  # so its session need not
    *deltas, finished = box.take()[1:]
    assert "".join(d.text for d in deltas) == "ab"
    assert isinstance(finished, Finished) and finished.stop_string == "cd"
    late = TokenStep(request_id="r", tokens=(ord("x"),), finish_reason="length")
    assert state.on_step(EngineStep(tokens=(late,))) == [] and len(state) == 0


def test_requests_that_ended_elsewhere_are_forgotten():
    """A request aborted mid-stream (client gone, timed out) gets no final step from the
    engine: the streamer drops its state once its mailbox is gone or has ended."""
    boxes = Mailboxes()
    for rid in ("gone", "timed_out", "live"):
        boxes.register(rid)
    state = StreamState(SpecialTokenizer(), boxes)
    started = tuple(Started(request_id=r, prompt_tokens=3) for r in ("gone", "timed_out", "live"))
    state.on_step(EngineStep(started=started))
    assert len(state) == 3
    boxes.unregister("gone")
    boxes.deliver(Failed(request_id="timed_out", reason="request_timeout", message="late"))
    assert state.on_step(EngineStep()) == [] and len(state) == 1


class KimiK3Tokenizer(SpecialTokenizer):
    """Kimi K3's markup tokens as special ones (ids 3-5), and ``<s>`` (2)."""

    added_tokens_decoder = {
        2: Added("<s>", True),
        3: Added("<|open|>", True),
        4: Added("<|sep|>", True),
        5: Added("<|close|>", True),
    }


def test_reasoning_tags_spelled_in_several_special_tokens_reach_the_parser(monkeypatch):
    """Without tools, Kimi K3's reasoning tag ``<|open|>think<|sep|>`` (three tokens) and its
    response wrapper must still reach the parser: every special token in them is shown."""
    import tests.test_streamer as here

    monkeypatch.setattr(here, "SpecialTokenizer", KimiK3Tokenizer)
    tokens = [
        2,
        3,
        *codes("think"),
        4,
        *codes("hmm"),
        5,
        *codes("think"),
        4,
        3,
        *codes("response"),
        4,
        *codes("Hi."),
        5,
        *codes("response"),
        4,
    ]
    spec = OutputSpec(reasoning=("<|open|>think<|sep|>", "<|close|>think<|sep|>"))
    deltas, _ = run(spec, tokens)
    assert "".join(d.reasoning for d in deltas) == "hmm"
    assert "".join(d.text for d in deltas) == "Hi."
