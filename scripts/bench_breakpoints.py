"""What client cache breakpoints cost the tokenizer stage: ``render_chat`` on an agent-sized
conversation (a long system prompt, then tool-use turns) with no checkpoints, with the
automatic ones (system prompt, previous turn) and with those plus breakpoints.

    .venv/bin/python -m mlxd.scripts.bench_breakpoints [--model DIR] [--tokens 20000]

``--model``: a model directory with a tokenizer and a chat template (default: SmolLM2,
converted from the bundled GGUF into the model cache on first use).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from mlxd.actors.tokenizer import PromptBuilder
from mlxd.protocol.messages import ChatRequest, Message, SamplingParams


def default_model() -> Path:
    from mlxd.actors.engine.loading.gguf.convert import convert_gguf, default_model_path

    return convert_gguf(default_model_path(), Path(tempfile.mkdtemp()), lambda _: None)


def conversation(encode, tokens: int) -> list[Message]:
    """About ``tokens`` tokens: a system prompt of 60% of them, then user / assistant turns."""
    line = "Tool `read_file(path)`: returns the file's text; use it before editing any file. "
    system = ""
    while len(encode(system)) < tokens * 0.6:
        system += line * 20
    messages = [Message(role="system", content=system)]
    turn = 0
    while len(encode("".join(str(m.content) for m in messages))) < tokens:
        body = (
            f"Step {turn}: the test output shows a failure in module_{turn}.py, line {turn * 7}. "
        )
        messages.append(Message(role="user", content=body * 12))
        messages.append(Message(role="assistant", content=f"I will open module_{turn}.py. " * 8))
        turn += 1
    messages.append(Message(role="user", content="Now fix the remaining failure."))
    return messages


def timed(builder: PromptBuilder, request: ChatRequest, reps: int) -> tuple[float, int, tuple]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _, tokens, marks = builder.render_chat(request)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(tokens), marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.model or default_model()))
    messages = conversation(lambda t: tokenizer.encode(t, add_special_tokens=False), args.tokens)
    n = len(messages)
    # Claude Code's four: the system prompt, the last and the third-from-last message
    breakpoints = (0, n - 3, n - 1)
    sampling = SamplingParams(max_tokens=16)

    def request(marks: tuple[int, ...]) -> ChatRequest:
        return ChatRequest(
            request_id="b", messages=tuple(messages), sampling=sampling, cache_breakpoints=marks
        )

    def builder(checkpoints: bool) -> PromptBuilder:
        return PromptBuilder(
            tokenizer,
            1 << 20,
            default_max_tokens=16,
            vocab_size=len(tokenizer),
            checkpoints=checkpoints,
        )

    rows = [
        ("no checkpoints", builder(False), request(())),
        ("system + previous turn", builder(True), request(())),
        (f"+ breakpoints {breakpoints}", builder(True), request(breakpoints)),
    ]
    base = None
    figures = {}
    print(f"{'render_chat':<34} {'ms':>8} {'+ms':>8}  tokens  marks")
    for name, b, r in rows:
        ms, count, marks = timed(b, r, args.reps)
        base = ms if base is None else base
        print(f"{name:<34} {ms * 1e3:8.1f} {(ms - base) * 1e3:8.1f}  {count:6d}  {marks}")
        figures[f"{name} (ms)"] = ms * 1e3
    from mlxd.scripts import records  # docs/benchmarks.md is rendered from the records

    command = records.command(module="mlxd.scripts.bench_breakpoints")
    records.write("bench_breakpoints", command=command, figures=figures)


if __name__ == "__main__":
    main()
