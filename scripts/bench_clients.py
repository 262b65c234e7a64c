"""A real Claude Code session against mlxd and against vllm-mlx, on the same model, in one run.

Each server is started as a subprocess on a free loopback port, with a recording
proxy in front of it; Claude Code (``claude -p``, then ``claude -p --continue``
for the later turns) talks to the proxy. For every request the proxy records the
prompt size and cached tokens the server reported (Anthropic usage:
``input_tokens``, ``cache_read_input_tokens``), the time to the first streamed
content (TTFT) and the whole request's time. Prints one row per request and one
per turn: TTFT of the turn's first request, and the cached share of its prompt.

    python -m mlxd.scripts.bench_clients --claude PATH/TO/claude             # mlxd only
    python -m mlxd.scripts.bench_clients --claude .clients/node/node_modules/.bin/claude \\
        --vllm-mlx /tmp/vllm-venv/bin/vllm-mlx --model gemma --turns 3

``gemma`` is Gemma 3 270M (Q4_K_M GGUF from the test packages, 32k context; Claude
Code's first prompt is about 21k tokens), converted and dequantized to float32
as mlxd loads it on the CPU backend; both servers load that directory. ``tiny``
is a random-weight long-context model (answers are noise; the timings are the
servers'). ``CLAUDE_CODE_MAX_OUTPUT_TOKENS`` caps each answer (``--max-tokens``)
for both servers alike.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from mlxd.daemon import blas
from mlxd.scripts.bench_agents import _tail, command, converted, float32_copy, free_port

ROOT = Path(__file__).resolve().parent.parent
TURNS = (
    "List the files in this directory and say what the project is.",
    "Now read README.md and summarise it in one sentence.",
    "Thanks. What would you check first if the tests failed?",
)


@dataclass
class Record:
    """One request as the proxy saw it."""

    turn: int
    path: str
    status: int
    input_tokens: int = 0  # the prompt tokens the server did not read from its cache
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    total_s: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return self.input_tokens + self.cached_tokens


class Recorder:
    """What the proxy saw, per turn (set by the driver before each ``claude`` run)."""

    def __init__(self) -> None:
        self.turn = 0
        self.records: list[Record] = []
        self.lock = threading.Lock()

    def add(self, record: Record) -> None:
        with self.lock:
            self.records.append(record)


def _usage(record: Record, event: dict) -> None:
    usage = event.get("usage") or event.get("message", {}).get("usage") or {}
    for wire, name in (
        ("input_tokens", "input_tokens"),
        ("cache_read_input_tokens", "cached_tokens"),
        ("output_tokens", "output_tokens"),
    ):
        if usage.get(wire) is not None:
            setattr(record, name, usage[wire])


def _read_events(record: Record, chunk: bytes, buffer: bytearray, t0: float) -> None:
    """Parse SSE ``data:`` lines as they stream past: the first content is the TTFT."""
    buffer += chunk
    while b"\n" in buffer:
        line, _, rest = bytes(buffer).partition(b"\n")
        buffer[:] = rest
        if not line.startswith(b"data:"):
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            continue
        if event.get("type") == "content_block_delta" and record.ttft_s is None:
            record.ttft_s = time.perf_counter() - t0
        _usage(record, event)


def proxy_handler(upstream: str, recorder: Recorder) -> type[http.server.BaseHTTPRequestHandler]:
    import httpx

    client = httpx.Client(base_url=upstream, timeout=httpx.Timeout(None))

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def _forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            headers = {
                k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")
            }
            record = Record(turn=recorder.turn, path=self.path.split("?")[0], status=0)
            t0, buffer = time.perf_counter(), bytearray()
            with client.stream(self.command, self.path, content=body, headers=headers) as r:
                record.status = r.status_code
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for chunk in r.iter_raw():
                    if "event-stream" in r.headers.get("content-type", ""):
                        _read_events(record, chunk, buffer, t0)
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                if "json" in r.headers.get("content-type", ""):
                    try:
                        _usage(record, json.loads(r.read() or b"{}"))
                    except ValueError:
                        pass
            record.total_s = time.perf_counter() - t0
            recorder.add(record)

        do_POST = do_GET = _forward

    return Handler


@contextmanager
def proxy(upstream: str, recorder: Recorder) -> Iterator[str]:
    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), proxy_handler(upstream, recorder))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()


SERVED = "bench"  # the model id both servers answer to; Claude Code is told to ask for it


def server_command(server: str, model_dir: Path, port: int, vllm: str) -> tuple[list[str], dict]:
    if server == "mlxd":
        args, env = command("mlxd", model_dir, port)
        return [*args, "--served-model-name", SERVED], env
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    lib = blas.find_openblas()  # mlx[cpu]'s own BLAS is slow: as mlxd preloads it for itself
    if sys.platform == "linux" and lib:
        env["LD_PRELOAD"] = ":".join(filter(None, [lib, env.get("LD_PRELOAD")]))
    args = [vllm, "serve", str(model_dir), "--port", str(port), "--host", "127.0.0.1"]
    args += ["--served-model-name", SERVED, "--continuous-batching", "--enable-prefix-cache"]
    return args, env


@contextmanager
def serving(server: str, model_dir: Path, log: Path, vllm: str, timeout_s: float) -> Iterator[str]:
    import httpx

    port = free_port()
    cmd, env = server_command(server, model_dir, port, vllm)
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{server} exited with {proc.returncode}:\n{_tail(log)}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{server} not ready after {timeout_s:.0f} s:\n{_tail(log)}")
            time.sleep(1.0)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def claude_session(
    claude: str,
    base: str,
    recorder: Recorder,
    turns: int,
    max_tokens: int,
    work: Path,
    turn_timeout_s: float,
) -> list[float]:
    """Run ``turns`` turns of one Claude Code session; returns each turn's wall time."""
    home = work / "home"
    home.mkdir(exist_ok=True)
    (work / "README.md").write_text("# demo\n\nA small demo project with one module.\n")
    env = dict(
        os.environ,
        HOME=str(home),
        ANTHROPIC_BASE_URL=base,
        ANTHROPIC_API_KEY="x",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(max_tokens),
        ANTHROPIC_MODEL=SERVED,  # vllm-mlx refuses other ids
        ANTHROPIC_SMALL_FAST_MODEL=SERVED,
        ANTHROPIC_DEFAULT_HAIKU_MODEL=SERVED,
    )
    walls = []
    for turn in range(turns):
        recorder.turn = turn + 1
        args = [claude, "-p", *(["--continue"] if turn else []), TURNS[turn % len(TURNS)]]
        t0 = time.perf_counter()
        try:
            done = subprocess.run(
                args, env=env, cwd=work, capture_output=True, timeout=turn_timeout_s
            )
        except subprocess.TimeoutExpired:
            walls.append(time.perf_counter() - t0)
            print(f"  turn {turn + 1}: no answer within {turn_timeout_s:.0f} s", flush=True)
            continue
        walls.append(time.perf_counter() - t0)
        if done.returncode != 0:
            print(f"  turn {turn + 1}: claude exited {done.returncode}: {done.stdout[-300:]!r}")
    return walls


# Gemma 3's turn markup: the GGUF in the test packages is a base model without a template.
GEMMA_TEMPLATE = """{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == \
'assistant' else 'user' %}<start_of_turn>{{ role }}
{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}\
{{ p['text'] }}{% endfor %}{% endif %}<end_of_turn>
{% endfor %}{% if add_generation_prompt %}<start_of_turn>model
{% endif %}"""


def with_template(model_dir: Path, out: Path, template: str) -> Path:
    """``model_dir`` with another chat template: its files linked into ``out``."""
    out.mkdir()
    for f in model_dir.iterdir():
        if f.name != "chat_template.jinja":
            (out / f.name).symlink_to(f.resolve())
    (out / "chat_template.jinja").write_text(template)
    return out


def prepare(name: str, tmp: Path) -> Path:
    if name == "gemma":
        from mlxd.scripts.gguf_sample import gemma3_270m

        model_dir = float32_copy(converted(gemma3_270m(tmp / "gguf")), tmp / "float32")
        return with_template(model_dir, tmp / "gemma", GEMMA_TEMPLATE)
    if name == "tiny":
        from mlxd.scripts.tiny_models import LONG_CONTEXT, build_text_model

        return build_text_model(LONG_CONTEXT, converted(), tmp / "tiny")
    return Path(name)


def report(server: str, records: list[Record], walls: list[float]) -> list[str]:
    lines = [f"{server}:"]
    lines.append("  turn  route          status  prompt  cached  out   TTFT s  total s")
    for r in records:
        ttft = f"{r.ttft_s:6.1f}" if r.ttft_s is not None else "     -"
        lines.append(
            f"  {r.turn:>4}  {r.path:<14} {r.status:>6} {r.prompt_tokens:>7} "
            f"{r.cached_tokens:>7} {r.output_tokens:>4} {ttft}  {r.total_s:7.1f}"
        )
    for turn, wall in enumerate(walls, 1):
        mine = [r for r in records if r.turn == turn and r.path == "/v1/messages"]
        if not mine:
            continue
        first, prompt = mine[0], sum(r.prompt_tokens for r in mine)
        share = sum(r.cached_tokens for r in mine) / prompt if prompt else 0.0
        ttft = f"{first.ttft_s:.1f} s" if first.ttft_s is not None else "-"
        lines.append(
            f"  turn {turn}: {len(mine)} requests, first TTFT {ttft}, "
            f"cached {share:.0%} of {prompt} prompt tokens, wall {wall:.1f} s"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--claude", required=True, help="the claude binary")
    p.add_argument("--vllm-mlx", default="", help="vllm-mlx binary; empty: mlxd alone")
    p.add_argument("--model", default="gemma", help="gemma | tiny | a model directory")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--timeout", type=float, default=900.0, help="server start-up limit (s)")
    p.add_argument("--turn-timeout", type=float, default=1200.0, help="one turn's limit (s)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    servers = ["mlxd"] + (["vllm-mlx"] if args.vllm_mlx else [])
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = prepare(args.model, tmp)
        for server in servers:
            recorder, work = Recorder(), tmp / f"work-{server}"
            work.mkdir()
            with (
                serving(
                    server, model_dir, tmp / f"{server}.log", args.vllm_mlx, args.timeout
                ) as url,
                proxy(url, recorder) as base,
            ):
                walls = claude_session(
                    args.claude,
                    base,
                    recorder,
                    args.turns,
                    args.max_tokens,
                    work,
                    args.turn_timeout,
                )
            print("\n".join(report(server, recorder.records, walls)), flush=True)
            out[server] = {"walls": walls, "requests": [asdict(r) for r in recorder.records]}
    if args.json:
        print(json.dumps(out, indent=2))
    from mlxd.scripts import records  # docs/benchmarks.md is rendered from the records

    figures = records.numbers({f"{server} turn walls (s)": o["walls"] for server, o in out.items()})
    command = records.command(argv, module="mlxd.scripts.bench_clients")
    records.write("bench_clients", command=command, peer="vllm-mlx" if args.vllm_mlx else None,
                  figures=figures)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
