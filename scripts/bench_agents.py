"""Agent workload: mlxd against ``mlx_lm.server`` on the same model, in one run.

K concurrent agents share a long system prompt (a tool manual); each holds a
T-turn conversation whose user turns look like tool output (code, logs, JSON,
part of it copied from earlier turns) and whose assistant replies are capped at
``--max-tokens`` greedy tokens and appended to the history, so prompts grow and
share prefixes as an agent's do. Each server is started as a subprocess on a free
loopback port, warmed up with one short request, given the workload and stopped;
then the next. Prints per server the wall time, TTFT p50/p95 over all turns and
over turn 1 alone, and the prompt, cached and generated tokens the server
reported, then the ratio mlx_lm.server / mlxd (above 1: mlxd is faster).

    python -m mlxd.scripts.bench_agents                       # default model, both servers
    python -m mlxd.scripts.bench_agents --model hybrid --agents 4 --turns 5 --json
    python -m mlxd.scripts.bench_agents --model DIR --servers mlxd

``default`` is SmolLM2-135M-Instruct converted from the bundled GGUF; ``hybrid``
a random-weight Qwen3.5-architecture model (GatedDeltaNet + attention) of about
SmolLM2's compute, built in a temporary directory with SmolLM2's tokenizer. On
the CPU backend a quantized model is dequantized once to float32 into a
temporary directory and both servers load that directory (mlxd would dequantize
it anyway; ``mlx_lm.server`` would not). On Linux ``mlx_lm.server`` runs with
OpenBLAS preloaded, as mlxd's launcher does for itself.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlxd.daemon import blas
from mlxd.daemon.bench import percentile

ROOT = Path(__file__).resolve().parent.parent
SERVERS = ("mlxd", "mlx_lm")
LABELS = {"mlxd": "mlxd", "mlx_lm": "mlx_lm.server"}

# ---- the workload (deterministic text) ------------------------------------------------

_TOOLS = (
    ("read_file", "Read a file of the repository and return its contents with line numbers."),
    ("write_file", "Replace a file's contents; the parent directory must exist."),
    ("edit_file", "Replace one exact occurrence of a string in a file with another string."),
    ("list_dir", "List the entries of a directory, directories first, with sizes."),
    ("grep", "Search files for a regular expression and return matching lines."),
    ("run_tests", "Run the test suite, or the tests matching a pattern, and return the log."),
    ("run_shell", "Run a shell command in the repository root and return its output."),
    ("git_diff", "Show the uncommitted changes, or those between two revisions."),
    ("http_get", "Fetch a URL and return the status, headers and the first 64 KiB of body."),
)
_PARAMS = (
    ("path", "string", "a path relative to the repository root"),
    ("pattern", "string", "a regular expression in Python syntax"),
    ("timeout_s", "number", "seconds before the call is cancelled (default 60)"),
    ("max_lines", "integer", "lines of output kept; the rest is elided (default 400)"),
    ("recursive", "boolean", "whether to descend into subdirectories (default false)"),
)


def tool_manual() -> str:
    """The shared system prompt: an agent's instructions and a manual of its tools (~1.3k tokens)."""
    lines = [
        "You are a coding agent working in a software repository. You act only through",
        "the tools below. Think about what you need, call one tool at a time, read its",
        "output carefully, and stop when the task is done. Keep replies short.",
        "",
        "# Tools",
    ]
    for i, (name, purpose) in enumerate(_TOOLS):
        lines += ["", f"## {name}", purpose, "Parameters:"]
        for j in range(3):
            pname, ptype, doc = _PARAMS[(i + j) % len(_PARAMS)]
            lines.append(f"- {pname} ({ptype}, {'required' if j == 0 else 'optional'}): {doc}")
        example = {_PARAMS[i % len(_PARAMS)][0]: f"src/module_{i}.py"}
        lines.append(f'Example: {{"tool": "{name}", "arguments": {json.dumps(example)}}}')
        lines.append(f"Errors: a failed {name} call returns an object with an 'error' field.")
    lines += [
        "",
        "# Rules",
        "1. Never guess file contents: read them first.",
        "2. Prefer small edits; re-read a file after editing it.",
        "3. Run the tests after every change and quote the failing lines.",
        "4. Answer with a single JSON tool call, or with DONE and a one-line summary.",
    ]
    return "\n".join(lines)


_WORDS = (
    "cache user order token batch queue stream record index config session "
    "packet window buffer parser report invoice account ledger payload"
).split()


def _code(rng: random.Random, functions: int = 4) -> str:
    out = ["import json", "from pathlib import Path", ""]
    for _ in range(functions):
        a, b = rng.sample(_WORDS, 2)
        n = rng.randint(2, 9)
        out += [
            f"def load_{a}_{b}(path: Path, limit: int = {n * 10}) -> list[dict]:",
            f'    """Read {a} records and keep the {b} fields."""',
            "    rows = json.loads(path.read_text())[:limit]",
            f'    return [{{"{a}": r["{a}"], "{b}": r.get("{b}", {n})}} for r in rows]',
            "",
        ]
    return "\n".join(out)


def _logs(rng: random.Random, n: int = 8) -> str:
    levels = ("INFO", "INFO", "INFO", "WARNING", "ERROR")
    out = []
    for i in range(n):
        a, b = rng.sample(_WORDS, 2)
        out.append(
            f"2026-11-23T14:{10 + i:02d}:{rng.randint(0, 59):02d}Z {rng.choice(levels):7s} "
            f"{a}.{b}: processed {rng.randint(1, 999)} {a} records in {rng.randint(1, 400)} ms"
        )
    out.append(f"FAILED tests/test_{rng.choice(_WORDS)}.py::test_roundtrip - KeyError: 'id'")
    return "\n".join(out)


def _json(rng: random.Random, n: int = 5) -> str:
    rows = [
        {"id": rng.randint(1000, 9999), "kind": rng.choice(_WORDS), "size": rng.randint(1, 10**6)}
        for _ in range(n)
    ]
    return json.dumps({"status": 200, "rows": rows, "next": None}, indent=1)


def tool_outputs(agent: int, turns: int) -> list[str]:
    """The user turns of one agent: tool output, some of it copied from its earlier turns."""
    rng = random.Random(f"agent-{agent}")
    code, logs = _code(rng), _logs(rng)
    outs = [
        f"Task {agent}: fix the failing test. read_file src/app_{agent}.py returned:\n{code}",
        f"run_tests returned:\n{logs}",
    ]
    for turn in range(2, turns):
        match turn % 4:
            case 2:  # the file again after a one-line edit: a copy of turn 1 but one line
                code = code.replace("limit]", "limit] or []", 1)
                outs.append(f"edit_file applied. read_file src/app_{agent}.py returned:\n{code}")
            case 3:
                outs.append(f"http_get returned:\n{_json(rng)}")
            case 0:  # the same log with a few new lines at the end
                logs = logs + "\n" + _logs(rng, 3)
                outs.append(f"run_tests returned:\n{logs}")
            case _:
                outs.append(f"git_diff returned:\n{_code(rng, 2)}")
    return outs[:turns]


# ---- one agent over HTTP ----------------------------------------------------------------


@dataclass
class Turn:
    """One request of one agent: timings in seconds and the server's usage numbers."""

    agent: int
    turn: int
    ttft: float | None = None
    e2e: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    completion_tokens: int = 0
    finish: str | None = None
    error: str | None = None


def _body(messages: list[dict], max_tokens: int) -> dict:
    return {
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": max_tokens,
    }


def _on_event(turn: Turn, event: dict, t0: float, text: list[str]) -> None:
    if "error" in event:
        turn.error = str(event["error"].get("message", event["error"]))
    if usage := event.get("usage"):
        turn.prompt_tokens = usage.get("prompt_tokens", 0)
        turn.completion_tokens = usage.get("completion_tokens", 0)
        turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    for choice in event.get("choices", ()):
        delta = choice.get("delta") or {}
        turn.finish = choice.get("finish_reason") or turn.finish
        produced = [delta.get(k) for k in ("content", "reasoning_content", "reasoning")]
        if any(produced) or delta.get("tool_calls"):
            turn.ttft = turn.ttft if turn.ttft is not None else time.perf_counter() - t0
            text.append(delta.get("content") or "")


async def chat(client, url: str, messages: list[dict], max_tokens: int, turn: Turn) -> str:
    """One streaming chat request; fills ``turn`` and returns the reply's text."""
    import httpx

    text: list[str] = []
    t0 = time.perf_counter()
    try:
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=_body(messages, max_tokens)
        ) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                turn.error = f"HTTP {response.status_code}: {body[:200]}"
            else:
                async for line in response.aiter_lines():
                    if line.startswith("data:") and (data := line[5:].strip()) != "[DONE]":
                        _on_event(turn, json.loads(data), t0, text)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        turn.error = f"{type(exc).__name__}: {exc}"
    turn.e2e = time.perf_counter() - t0
    return "".join(text)


async def agent(client, url: str, index: int, turns: int, max_tokens: int, out: list[Turn]):
    """One conversation: each reply goes into the history before the next tool output."""
    messages = [{"role": "system", "content": tool_manual()}]
    for t, output in enumerate(tool_outputs(index, turns), start=1):
        messages.append({"role": "user", "content": output})
        turn = Turn(agent=index, turn=t)
        out.append(turn)
        reply = await chat(client, url, messages, max_tokens, turn)
        if turn.error:
            return  # the conversation cannot go on without its reply
        messages.append({"role": "assistant", "content": reply})


async def workload(url: str, agents: int, turns: int, max_tokens: int) -> tuple[float, list[Turn]]:
    import httpx
    import trio

    results: list[Turn] = []
    limits = httpx.Limits(max_connections=agents + 4, max_keepalive_connections=agents + 4)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(agents):
                nursery.start_soon(agent, client, url, i, turns, max_tokens, results)
        return time.perf_counter() - t0, results


# ---- servers as subprocesses ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(
    server: str,
    model_dir: Path,
    port: int,
    mlxd_config: Path | None = None,
    blas_threads: int = 0,
) -> tuple[list[str], dict[str, str]]:
    """How to start ``server``; both get ``blas_threads`` OpenBLAS threads (mlxd through its
    setting, mlx_lm.server through OpenBLAS's environment variable; 0: OpenBLAS's default)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if server == "mlxd":  # its launcher preloads OpenBLAS itself
        env["MLXD_ENGINE__BLAS_THREADS"] = str(blas_threads)
        args = ["mlxd.daemon.cli", "serve", str(model_dir), "--port", str(port)]
        if mlxd_config is not None:
            args += ["--config", str(mlxd_config)]
        return [sys.executable, "-m", *args], env
    lib = blas.find_openblas()
    if sys.platform == "linux" and lib:
        env["LD_PRELOAD"] = ":".join(filter(None, [lib, env.get("LD_PRELOAD")]))
        if blas_threads > 0:
            env["OPENBLAS_NUM_THREADS"] = str(blas_threads)
    args = ["mlx_lm.server", "--model", str(model_dir), "--port", str(port)]
    return [sys.executable, "-m", *args], env


def _tail(log: Path, n: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> float:
    """Poll with a short chat request (which also warms the server up); returns seconds."""
    import httpx

    t0 = time.perf_counter()
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{_tail(log)}")
        try:
            if httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise SystemExit(f"server not ready after {timeout_s:.0f} s:\n{_tail(log)}")


@contextmanager
def serving(
    server: str,
    model_dir: Path,
    log: Path,
    timeout_s: float,
    mlxd_config: Path | None = None,
    blas_threads: int = 0,
) -> Iterator[tuple[str, float]]:
    """Start ``server`` on a free port, yield its URL and the seconds it took to answer
    (load and warm-up) once it does, stop it after."""
    port = free_port()
    cmd, env = command(server, model_dir, port, mlxd_config, blas_threads)
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        yield url, wait_ready(url, proc, log, timeout_s)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- models ----------------------------------------------------------------------------------


def _qwen3_5_hybrid() -> dict:
    """A Qwen3.5 hybrid of about SmolLM2-135M's compute: 28 layers (7 full attention, 21
    GatedDeltaNet) at width 576, ~107M parameters besides the (untied) embeddings."""
    from mlxd.scripts.tiny_models import QWEN3_5

    return {
        **QWEN3_5,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "full_attention_interval": 4,
        "max_position_embeddings": 8192,
    }


def converted(gguf: Path | None = None) -> Path:
    """A GGUF file (default: the bundled SmolLM2-135M-Instruct) as an mlx-lm directory,
    cached under ~/.cache/mlxd as mlxd caches it."""
    from mlxd.actors.engine.loading.gguf.convert import convert_gguf, default_model_path

    source = gguf or default_model_path()
    return convert_gguf(source, Path("~/.cache/mlxd").expanduser(), lambda _: None)


def float32_copy(model_dir: Path, out: Path) -> Path:
    """``model_dir`` dequantized to float32 in ``out`` when it is quantized and MLX runs on
    the CPU (as mlxd loads it there), else ``model_dir`` itself."""
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model, load, save_model
    from mlxd.actors.engine.loading.load import backend
    from mlxd.scripts.tiny_models import copy_tokenizer

    config = json.loads((model_dir / "config.json").read_text())
    if "quantization" not in config or backend() != "cpu":
        return model_dir
    model, _ = load(str(model_dir))
    model = dequantize_model(model)
    model.set_dtype(mx.float32)
    save_model(out, model)
    for key in ("quantization", "quantization_config"):
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(model_dir, out)
    return out


def prepare(name: str, tmp: Path) -> tuple[Path, str]:
    """The model directory both servers load, and a line describing it."""
    if name == "hybrid":
        from mlxd.scripts.tiny_models import build_text_model

        out = build_text_model(_qwen3_5_hybrid(), converted(), tmp / "hybrid")
        return out, "random-weight Qwen3.5 hybrid (28 layers, width 576), float32"
    source = Path(name)
    if name == "default" or source.suffix == ".gguf":
        source = converted(None if name == "default" else source)
    model_dir = float32_copy(source, tmp / "float32")
    label = "SmolLM2-135M-Instruct (Q4_1 GGUF)" if name == "default" else name
    if model_dir != source:
        return model_dir, f"{label}, dequantized to float32"
    config = json.loads((model_dir / "config.json").read_text())
    suffix = model_dir.name.rpartition("-")[2]  # a converted GGUF's directory names its dtype
    dtype = config.get("torch_dtype") or config.get("dtype")
    dtype = dtype or (suffix if suffix in ("float32", "float16", "bfloat16") else None)
    return model_dir, f"{label}, as mlxd loads it" + (f" ({dtype})" if dtype else "")


# ---- report -------------------------------------------------------------------------------------


@dataclass
class ServerRun:
    """One server's pass over the workload."""

    server: str
    wall_s: float
    load_s: float
    turns: list[Turn] = field(default_factory=list)

    def summary(self) -> dict:
        ok = [t for t in self.turns if t.error is None and t.ttft is not None]
        ttft = [t.ttft for t in ok]
        first = [t.ttft for t in ok if t.turn == 1]
        cached = [t.cached_tokens for t in ok if t.cached_tokens is not None]
        return {
            "server": LABELS[self.server],
            "wall_s": self.wall_s,
            "load_s": self.load_s,
            "requests": len(self.turns),
            "failed": len(self.turns) - len(ok),
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p95_s": percentile(ttft, 95),
            "turn1_ttft_p50_s": percentile(first, 50),
            "turn1_ttft_p95_s": percentile(first, 95),
            "ttft_p50_by_turn_s": [
                percentile([t.ttft for t in ok if t.turn == n], 50)
                for n in range(1, 1 + max((t.turn for t in self.turns), default=0))
            ],
            "prompt_tokens": sum(t.prompt_tokens for t in ok),
            "cached_tokens": sum(cached) if cached else None,
            "completion_tokens": sum(t.completion_tokens for t in ok),
            "errors": sorted({t.error for t in self.turns if t.error}),
        }


_COLUMNS = (  # (header, summary key, width, format)
    ("server", "server", 13, "s"),
    ("wall_s", "wall_s", 7, ".1f"),
    ("failed", "failed", 6, "d"),
    ("ttft_p50", "ttft_p50_s", 8, ".2f"),
    ("ttft_p95", "ttft_p95_s", 8, ".2f"),
    ("t1_p50", "turn1_ttft_p50_s", 7, ".2f"),
    ("t1_p95", "turn1_ttft_p95_s", 7, ".2f"),
    ("prompt_tok", "prompt_tokens", 10, "d"),
    ("cached_tok", "cached_tokens", 10, "d"),
    ("gen_tok", "completion_tokens", 7, "d"),
)


def _cell(value, i: int, width: int, fmt: str) -> str:
    align = "<" if i == 0 else ">"
    return f"{'-' if value is None else format(value, fmt):{align}{width}}"


def ratios(runs: list[ServerRun]) -> dict[str, float]:
    """mlx_lm.server ÷ mlxd for wall time and each TTFT figure (above 1: mlxd is faster)."""
    by = {r.server: r.summary() for r in runs}
    if not {"mlxd", "mlx_lm"} <= by.keys():
        return {}
    keys = ("wall_s", "ttft_p50_s", "ttft_p95_s", "turn1_ttft_p50_s", "turn1_ttft_p95_s")
    return {k: by["mlx_lm"][k] / by["mlxd"][k] for k in keys if by["mlxd"][k] > 0}


def report(title: str, runs: list[ServerRun]) -> str:
    lines = [title, "  ".join(_cell(h, i, w, "s") for i, (h, _, w, _) in enumerate(_COLUMNS))]
    summaries = [run.summary() for run in runs]
    for s in summaries:
        lines.append("  ".join(_cell(s[k], i, w, f) for i, (_, k, w, f) in enumerate(_COLUMNS)))
    for s in summaries:
        by_turn = " ".join(f"{v:.1f}" for v in s["ttft_p50_by_turn_s"])
        lines.append(f"{s['server']} TTFT p50 by turn (s): {by_turn}")
        lines += [f"{s['server']} error: {e}" for e in s["errors"]]
    if r := ratios(runs):
        lines.append(
            "mlx_lm.server / mlxd: "
            + ", ".join(f"{k.removesuffix('_s')} x{v:.2f}" for k, v in r.items())
        )
    return "\n".join(lines)


# ---- command line -------------------------------------------------------------------------------


def bench_model(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    import trio

    model_dir, description = prepare(name, tmp / name.replace("/", "_"))
    runs = []
    for server in args.servers:
        log = tmp / f"{name.replace('/', '_')}-{server}.log"
        with serving(
            server, model_dir, log, args.ready_timeout, args.mlxd_config, args.blas_threads
        ) as (url, load_s):
            wall, turns = trio.run(workload, url, args.agents, args.turns, args.max_tokens)
            runs.append(ServerRun(server, wall, load_s, turns))
        if args.keep_logs:
            print(f"{LABELS[server]} log: {log}", file=sys.stderr)
    return {"model": name, "description": description, "dir": str(model_dir), "runs": runs}


def _title(result: dict, args: argparse.Namespace) -> str:
    return (
        f"model {result['model']}: {result['description']}; {args.agents} agents x "
        f"{args.turns} turns, {args.max_tokens} tokens per reply, greedy"
    )


def _servers(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names or set(names) - set(SERVERS):
        raise argparse.ArgumentTypeError(f"servers are a comma list of {', '.join(SERVERS)}")
    return names


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_agents", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default="default", help="DIR, FILE.gguf, default or hybrid; a comma list"
    )
    p.add_argument("--agents", type=int, default=4, help="concurrent conversations (K)")
    p.add_argument("--turns", type=int, default=5, help="requests per conversation (T)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per reply")
    p.add_argument("--servers", type=_servers, default=list(SERVERS), help="e.g. mlxd,mlx_lm")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to load a model")
    p.add_argument("--mlxd-config", type=Path, help="a TOML settings file for mlxd")
    p.add_argument(
        "--blas-threads",
        type=int,
        default=0,
        help="OpenBLAS threads for both servers (0: OpenBLAS's default, mlxd's default too)",
    )
    p.add_argument("--keep-logs", action="store_true", help="keep the servers' logs and say where")
    p.add_argument("--json", action="store_true", help="print machine-readable results")
    return p


def _revision() -> str:
    """The checkout mlxd runs from (``-dirty``: with uncommitted changes)."""
    git = ["git", "-C", str(ROOT), "describe", "--always", "--dirty"]
    done = subprocess.run(git, capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    versions = {
        "mlxd": _revision(),
        "mlx_lm": importlib.metadata.version("mlx-lm"),
        "mlx": importlib.metadata.version("mlx"),
    }
    tmp = Path(tempfile.mkdtemp(prefix="bench_agents."))
    results = [bench_model(name, args, tmp) for name in args.model.split(",")]
    if not args.keep_logs:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        out = {
            "versions": versions,
            "agents": args.agents,
            "turns": args.turns,
            "max_tokens": args.max_tokens,
            "models": [
                {
                    **{k: v for k, v in r.items() if k != "runs"},
                    "results": [run.summary() for run in r["runs"]],
                    "ratios": ratios(r["runs"]),
                    "turns": {run.server: [asdict(t) for t in run.turns] for run in r["runs"]},
                }
                for r in results
            ],
        }
        print(json.dumps(out, indent=2))
    else:
        preload = blas.find_openblas() if sys.platform == "linux" else None
        print(
            f"mlxd {versions['mlxd']}, "
            f"mlx-lm {versions['mlx_lm']} (mlx_lm.server with its default flags), "
            f"mlx {versions['mlx']}; OpenBLAS preloaded for both: {preload or 'no'}, "
            f"{args.blas_threads or 'default'} thread(s)"
        )
        for r in results:
            print("\n" + report(_title(r, args), r["runs"]))
    failed = sum(s["failed"] for r in results for s in (run.summary() for run in r["runs"]))
    _record(results, args, argv)
    return 1 if failed else 0


def _record(results: list[dict], args: argparse.Namespace, argv: list[str] | None) -> None:
    """The run as a record in docs/results (docs/benchmarks.md is rendered from them)."""
    from mlxd.scripts import records

    rows, figures = [], {}
    for r in results:
        by = {run.server: run.summary() for run in r["runs"]}
        figures |= records.numbers({r["model"]: by})
        if {"mlxd", "mlx_lm"} <= by.keys():
            for metric, key in (("wall time", "wall_s"), ("TTFT p50", "ttft_p50_s")):
                mlxd, peer = by["mlxd"][key], by["mlx_lm"][key]
                rows.append(records.compared(r["model"], metric, better="lower", unit="s",
                                             mlxd=mlxd, peer=peer))  # fmt: skip
    notes = (
        f"{args.agents} agents x {args.turns} turns sharing a prefix, {args.max_tokens}-token "
        "replies, greedy."
    )
    command = records.command(argv, module="mlxd.scripts.bench_agents")
    records.write("bench_agents", command=command, peer="mlx_lm.server", rows=rows,
                  figures=figures, notes=notes)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
