"""Code completion as one types: mlxd's ``/infill`` warm, the same requests cold, and
``mlx_lm.server`` given the same FIM prompt as a plain completion.

A replay of someone typing into a 300-line Python file from a package in the venv
(``httpx/_urlparse.py``'s first 300 lines): the cursor sits where about 2,000 tokens
of the file come before it and about 500 after; the next line(s) of the file are
typed ``--step`` characters at a time, with a completion request after each step
(``--requests`` of them, one after the other, as an editor sends them), ``n_predict``
32, greedy, streamed. Each server answers the same requests in turn:

- ``mlxd``: ``/infill`` (``input_prefix`` holds what was typed: the prefix grows at
  its end, as OpenAI's and Ollama's ``suffix`` requests have it), prefix cache on;
- ``mlxd-cold``: the same with ``[prefix_cache] enabled = false``;
- ``mlx_lm``: ``mlx_lm.server``'s ``/v1/completions`` with the FIM prompt spelled out
  (``<fim_prefix>PREFIX<fim_suffix>SUFFIX<fim_middle>``, its special tokens parsed as
  single tokens by the same tokenizer), ``max_tokens`` 32.

The model is SmolLM2-135M-Instruct (the default GGUF, float32 on the CPU) wearing
StarCoder2's FIM tokens: SmolLM2's vocabulary has ``<repo_name>`` and ``<file_sep>``
but no ``<fim_*>``, so three of its unused special tokens (``<jupyter_start>``,
``<jupyter_text>``, ``<jupyter_code>``) are renamed ``<fim_prefix>``, ``<fim_middle>``,
``<fim_suffix>``. Its weights never learned FIM: the middles are not good code; the
benchmark measures the latency of serving them. TTFT is to the first streamed text;
completion time to the end of the stream. Writes a record (``scripts/records.py``).

    python -m mlxd.scripts.bench_fim                      # 20 requests, 3 characters apart
    python -m mlxd.scripts.bench_fim --requests 12 --step 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from mlxd.scripts import bench_agents, records

SOURCE = "httpx/_urlparse.py"
RENAMED = {"<jupyter_start>": "<fim_prefix>", "<jupyter_text>": "<fim_middle>"}
RENAMED["<jupyter_code>"] = "<fim_suffix>"
N_PREDICT = 32


def wear_fim_tokens(model_dir: Path, out: Path) -> Path:
    """``model_dir`` with three unused special tokens renamed StarCoder2's FIM tokens (its
    other files linked)."""
    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.name in ("tokenizer.json", "tokenizer_config.json"):
            text = f.read_text()
            for old, new in RENAMED.items():
                text = text.replace(json.dumps(old), json.dumps(new))
            (out / f.name).write_text(text)
        else:
            (out / f.name).symlink_to(f.resolve())
    return out


@dataclass
class Typing:
    """The file around the cursor and the text typed at it."""

    prefix: str
    typed: str
    suffix: str

    def request(self, i: int, step: int) -> tuple[str, str]:
        """Request ``i``'s (prefix, suffix): ``(i + 1) * step`` characters typed."""
        return self.prefix + self.typed[: (i + 1) * step], self.suffix


def source_file() -> str:
    import httpx as package

    path = Path(package.__file__).parent.parent / SOURCE
    return "".join(path.read_text().splitlines(keepends=True)[:300])


def typing_replay(count, text: str, prefix_tokens: int, suffix_tokens: int, chars: int) -> Typing:
    """The cursor at the first line where ``prefix_tokens`` tokens come before it; the
    next lines (``chars`` characters) are typed; ``suffix_tokens`` tokens follow them."""
    lines = text.splitlines(keepends=True)
    cut = next(i for i in range(len(lines)) if count("".join(lines[:i])) >= prefix_tokens)
    prefix, rest = "".join(lines[:cut]), "".join(lines[cut:])
    typed, after = rest[:chars], rest[chars:]
    after_lines = after.splitlines(keepends=True)
    end = next(
        (i for i in range(len(after_lines)) if count("".join(after_lines[:i])) >= suffix_tokens),
        len(after_lines),
    )
    return Typing(prefix, typed, "".join(after_lines[:end]))


@dataclass
class Result:
    ttft_s: list[float] = field(default_factory=list)
    total_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)


def _frames(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line.removeprefix("data: "))


def infill(http: httpx.Client, prefix: str, suffix: str, out: Result) -> None:
    body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": N_PREDICT}
    body |= {"temperature": 0, "stream": True}
    t0, first = time.perf_counter(), None
    with http.stream("POST", "/infill", json=body) as r:
        r.raise_for_status()
        for frame in _frames(r):
            if frame.get("content") and first is None:
                first = time.perf_counter() - t0
            if frame["stop"]:
                last = frame
    out.total_s.append(time.perf_counter() - t0)
    out.ttft_s.append(first if first is not None else out.total_s[-1])
    out.tokens.append(last["tokens_predicted"])
    out.cached.append(last["tokens_cached"])
    out.prompt.append(last["tokens_evaluated"])


def plain(http: httpx.Client, prefix: str, suffix: str, out: Result) -> None:
    prompt = f"<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>"
    body = {"prompt": prompt, "max_tokens": N_PREDICT, "temperature": 0, "stream": True}
    t0, first, tokens = time.perf_counter(), None, 0
    with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for frame in _frames(r):
            text = frame["choices"][0].get("text") if frame.get("choices") else ""
            if text:
                tokens += 1
                first = first if first is not None else time.perf_counter() - t0
    out.total_s.append(time.perf_counter() - t0)
    out.ttft_s.append(first if first is not None else out.total_s[-1])
    out.tokens.append(tokens)


def run_arm(name: str, kind: str, model_dir: Path, typing: Typing, args, tmp: Path) -> Result:
    config = None
    if name == "mlxd-cold":
        config = tmp / "cold.toml"
        config.write_text("[prefix_cache]\nenabled = false\n")
    out, log = Result(), tmp / f"{name}.log"
    with bench_agents.serving(kind, model_dir, log, args.ready_timeout, config) as (url, _):
        with httpx.Client(base_url=url, timeout=args.timeout) as http:
            ask = infill if kind == "mlxd" else plain
            ask(http, "# warm-up\n" * 20, "\n", Result())  # the first FIM request, untimed
            for i in range(args.requests):
                ask(http, *typing.request(i, args.step), out)
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(name: str, r: Result) -> dict[str, float]:
    fig = {
        f"{name} TTFT p50 s": round(statistics.median(r.ttft_s), 3),
        f"{name} TTFT p95 s": round(pct(r.ttft_s, 0.95), 3),
        f"{name} completion p50 s": round(statistics.median(r.total_s), 3),
        f"{name} tokens generated mean": round(statistics.mean(r.tokens), 1),
    }
    if r.cached:
        share = [c / p for c, p in zip(r.cached[1:], r.prompt[1:], strict=True) if p]
        fig[f"{name} cached share of prompt (requests 2+)"] = round(statistics.mean(share), 3)
        fig[f"{name} prompt tokens mean"] = round(statistics.mean(r.prompt), 1)
    return fig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--step", type=int, default=3, help="characters typed between requests")
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--suffix-tokens", type=int, default=500)
    p.add_argument("--arms", default="mlxd,mlxd-cold,mlx_lm")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--no-record", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from transformers import AutoTokenizer

    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="mlxd-bench-fim-") as name:
        tmp = Path(name)
        base, label = bench_agents.prepare("default", tmp)
        model_dir = wear_fim_tokens(base, tmp / "fim-model")
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

        def count(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False))

        chars = args.requests * args.step
        typing = typing_replay(count, source_file(), args.prefix_tokens, args.suffix_tokens, chars)
        print(
            f"model: {label}, wearing StarCoder2's FIM tokens; {SOURCE}: prefix "
            f"{count(typing.prefix)} tokens, suffix {count(typing.suffix)}, "
            f"{args.requests} requests {args.step} characters apart",
            flush=True,
        )
        for arm in args.arms.split(","):
            kind = "mlx_lm" if arm == "mlx_lm" else "mlxd"
            result = run_arm(arm, kind, model_dir, typing, args, tmp)
            figures |= summary(arm, result)
            print(json.dumps(summary(arm, result)), flush=True)
    _ratios(figures)
    print(json.dumps(figures, indent=1))
    if not args.no_record:
        path = records.write(
            "bench_fim",
            command=records.command(module="mlxd.scripts.bench_fim"),
            peer="mlx_lm.server",
            figures=figures,
            notes=(
                f"{args.requests} completion requests {args.step} characters apart while "
                f"typing into {SOURCE} (~{args.prefix_tokens} tokens before the cursor, "
                f"~{args.suffix_tokens} after), n_predict {N_PREDICT}, greedy, streamed, one "
                "at a time; SmolLM2-135M wearing StarCoder2's FIM tokens (its weights never "
                "learned FIM). Cold: mlxd with the prefix cache off."
            ),
        )
        print(f"record: {path}")
    return 0


def _ratios(figures: dict[str, float]) -> None:
    warm = figures.get("mlxd TTFT p50 s")
    for other in ("mlxd-cold", "mlx_lm"):
        value = figures.get(f"{other} TTFT p50 s")
        if warm and value:
            figures[f"{other} / mlxd TTFT p50"] = round(value / warm, 2)


if __name__ == "__main__":
    sys.exit(main())
