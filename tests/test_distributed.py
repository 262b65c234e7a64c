"""One model over two ranks: ``mlx.launch --backend ring -n 2`` on loopback (CPU backend).

A tiny random Qwen3 (heads divide by 2) is served tensor parallel and a tiny random
Qwen3.5 hybrid pipeline parallel; their greedy outputs must equal mlx-lm's own
sharded generation over the same group (``tests/distributed_reference.py``), alone,
joined at different steps, and next to a request aborted mid-stream. A model that
can be sharded neither way is refused at start-up with one line; ranks whose
settings differ refuse to start; a follower killed mid-stream makes rank 0 answer
503 and exit non-zero within seconds. With ``engine.kv_bits = 8`` the pipeline-parallel
hybrid's output equals one process's with the same quantized KV. Small prefill chunks and prefix-cache blocks
make chunked prefill and the (lockstep) prefix cache take part.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.processes import wait_healthy

pytestmark = pytest.mark.mlx

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MAX_TOKENS = 10
# Token ids (SmolLM2's vocabulary): two share a 40-token start (a prefix-cache hit with
# 16-token blocks), one is long enough for several 16-token prefill chunks.
_SHARED = [(17 * i) % 4000 + 300 for i in range(40)]
PROMPTS = [
    [5000, 6000, 7000, 8000, 9000],
    [*_SHARED, 11, 12, 13],
    [*_SHARED, 21, 22, 23, 24, 25, 26],
    [(31 * i) % 9000 + 100 for i in range(70)],
]
ENV = {
    "MLXD_ENGINE__PREFILL_CHUNK_TOKENS": "16",
    "MLXD_PREFIX_CACHE__BLOCK_SIZE": "16",
    "MLXD_LOGGING__LEVEL": "INFO",
    "HF_HUB_OFFLINE": "1",
}


def _free_ports(n: int) -> int:
    """A port P with P .. P+n-1 free (the ring backend's ranks listen on consecutive ports)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65000 and all(_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm_tokenizer):
    from mlxd.scripts import tiny_models as tm

    root = tmp_path_factory.mktemp("distributed")
    return {
        "qwen3": tm.write_weight_index(
            tm.build_text_model(tm.QWEN3, smollm_tokenizer, root / "qwen3")
        ),
        "qwen3_5": tm.write_weight_index(
            tm.build_text_model(tm.QWEN3_5, smollm_tokenizer, root / "qwen3_5")
        ),
        "baichuan_m1": tm.build_text_model(tm.BAICHUAN_M1, smollm_tokenizer, root / "baichuan"),
        # heads of 32 values: a 32-value quantization group divides them (engine.kv_bits)
        "qwen3_5_hd32": tm.write_weight_index(
            tm.build_text_model({**tm.QWEN3_5, "head_dim": 32}, smollm_tokenizer, root / "hd32")
        ),
    }


def _launch(*command: str) -> list[str]:
    port = _free_ports(2)
    launcher = [str(BIN / "mlx.launch"), "--backend", "ring", "-n", "2"]
    return [*launcher, "--starting-port", str(port), "--", *command]


@pytest.fixture(scope="module")
def reference(models, tmp_path_factory):
    """mlx-lm's greedy sharded generation of every prompt, alone: {model name: [token ids]}."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    root = tmp_path_factory.mktemp("reference")
    runs = {"qwen3": "tensor", "qwen3_5": "pipeline"}
    spec = [
        {"model": str(models[n]), "mode": m, "prompts": PROMPTS, "max_tokens": MAX_TOKENS}
        for n, m in runs.items()
    ]
    (root / "spec.json").write_text(json.dumps(spec))
    command = _launch(sys.executable, "-m", "tests.distributed_reference")
    args = [str(root / "spec.json"), str(root / "out.json")]
    subprocess.run([*command, *args], cwd=ROOT, check=True, timeout=120, capture_output=True)
    tokens = json.loads((root / "out.json").read_text())
    decode = load_tokenizer(models["qwen3"]).decode
    return {name: [decode(t) for t in out] for name, out in zip(runs, tokens, strict=True)}


class Daemon:
    """Two ranks of ``mlxd serve MODEL --parallel X``; rank 0's HTTP at ``url``."""

    def __init__(self, procs: list[subprocess.Popen], url: str, logs: list[Path]):
        self.procs, self.url, self.logs = procs, url, logs

    @property
    def log(self) -> str:
        return "\n".join(log.read_text() for log in self.logs)

    def wait_ready(self, timeout: float = 120.0) -> None:
        alive = lambda: all(p.poll() is None for p in self.procs)  # noqa: E731
        wait_healthy(self.url, alive, timeout, lambda: self.log[-3000:])

    def complete(self, prompt: list[int], **extra) -> str:
        return self.completion(prompt, **extra)["choices"][0]["text"]

    def completion(self, prompt: list[int], **extra) -> dict:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
        reply = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()


def _serve_args(model: Path, parallel: str, port: int) -> list[str]:
    return [str(BIN / "mlxd"), "serve", str(model), "--parallel", parallel, "--port", str(port)]


def _stop(procs: list[subprocess.Popen]) -> None:
    """End what a test started: each process group (a launcher and its ranks) by its id."""
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended, and its group with it
        os.killpg(process.pid, signum)


def _start(command: list[str], log: Path, env: dict) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ENV, **env},
            start_new_session=True,  # its own process group: ``_stop`` ends it whole
        )


@contextmanager
def launched(tmp_path: Path, model: Path, parallel: str, env: dict | None = None):
    """``mlx.launch --backend ring -n 2 -- mlxd serve MODEL --parallel X``."""
    port = _free_ports(1)
    log = tmp_path / "daemon.log"
    process = _start(_launch(*_serve_args(model, parallel, port)), log, env or {})
    d = Daemon([process], f"http://127.0.0.1:{port}", [log])
    try:
        d.wait_ready()
        yield d
    finally:
        _stop([process])


@contextmanager
def ranks(tmp_path: Path, model: Path, extra: tuple[dict, dict] = ({}, {})):
    """The two ranks started by hand, as mlx.launch would but without its watch (it stops
    every rank once one exits): a rank that dies is left to the others to notice."""
    base = _free_ports(2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    port = _free_ports(1)
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    procs = []
    for rank in (0, 1):
        env = {**extra[rank], "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
        procs.append(_start(_serve_args(model, "auto", port), logs[rank], env))
    try:
        yield Daemon(procs, f"http://127.0.0.1:{port}", logs)
    finally:
        _stop(procs)


def _aborted_stream(d: Daemon, prompt: list[int]) -> None:
    """A stream the client leaves after its first chunks (the engine aborts it)."""
    body = {"prompt": prompt, "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{d.url}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        for n, _ in enumerate(reply.iter_lines()):
            if n >= 3:
                return


def _check_serving(d: Daemon, want: list[str]) -> None:
    # alone, one after another (the second shares a cached prefix with the first's)
    assert [d.complete(p) for p in PROMPTS] == want
    # together: staggered so that they join the batch at different steps, next to
    # a stream that is aborted mid-way
    with ThreadPoolExecutor(len(PROMPTS) + 1) as pool:
        aborted = pool.submit(_aborted_stream, d, PROMPTS[3])
        futures = []
        for p in PROMPTS:
            futures.append(pool.submit(d.completion, p))
            time.sleep(0.05)
        replies = [f.result() for f in futures]
        aborted.result()
    assert [r["choices"][0]["text"] for r in replies] == want
    # each prompt was seen before: every rank's prefix cache served it (in lockstep, or
    # the ranks' forward passes would not have matched)
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in replies)
    # sampled, unseeded: every rank draws the same tokens (a follower that decodes
    # other tokens than rank 0 stops, and rank 0 with it)
    for prompt in PROMPTS[:2]:
        d.complete(prompt, temperature=0.9, max_tokens=20)
    assert all(p.poll() is None for p in d.procs)


@pytest.fixture(scope="module")
def qwen3_ranks(models, tmp_path_factory):
    """The tiny Qwen3 on two ranks (``auto``: tensor parallel), speculation configured."""
    env = {
        "MLXD_SPECULATIVE__ENABLED": "true",
        "MLXD_SPECULATIVE__DRAFTER": "lookup",
        "MLXD_SPEC_PREFILL__ENABLED": "true",
        # a peer that dies mid-step can leave rank 0's next collective blocked: this long
        "MLXD_DISTRIBUTED__STEP_TIMEOUT_S": "4",
    }
    tmp_path = tmp_path_factory.mktemp("qwen3-ranks")
    with ranks(tmp_path, models["qwen3"], (env, env)) as d:
        d.wait_ready()
        yield d


def test_tensor_parallel_qwen3_equals_mlx_lm_sharded(qwen3_ranks, reference):
    d = qwen3_ranks
    _check_serving(d, reference["qwen3"])
    assert "tensor parallel" in d.log
    status = httpx.get(f"{d.url}/v1/status", timeout=10).json()
    assert "not served over several ranks" in json.dumps(status["speculative"])
    assert "not served over several ranks" in json.dumps(status["spec_prefill"])
    # a grammar matcher cannot travel to the other ranks: a 400, and serving goes on
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    constrained = {**body, "response_format": {"type": "json_object"}}
    reply = httpx.post(f"{d.url}/v1/chat/completions", json=constrained, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "response_format"
    assert httpx.post(f"{d.url}/v1/chat/completions", json=body, timeout=60).status_code == 200


def test_a_follower_that_dies_mid_stream_fails_requests_with_503_and_rank_0_exits(qwen3_ranks):
    d = qwen3_ranks
    body = {"prompt": PROMPTS[0], "max_tokens": 4000, "temperature": 0, "stream": True}
    seen: list[str] = []
    with httpx.stream("POST", f"{d.url}/v1/completions", json=body, timeout=30) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        for line in lines:
            seen.append(line)
            if len(seen) == 4:
                killed = time.monotonic()
                d.procs[1].send_signal(signal.SIGKILL)
                break
        seen.extend(lines)  # the rest, up to the end of the stream
    ended = time.monotonic() - killed
    code = d.procs[0].wait(timeout=15)
    gone = time.monotonic() - killed
    errors = [line for line in seen if '"error"' in line]
    assert errors, seen[-3:]
    assert "shutting_down" in errors[0]
    assert "group of machines serving this model broke" in errors[0]
    assert ended < 10, ended
    assert gone < 15, gone
    assert code == 3


def _rank_pids(launcher: subprocess.Popen) -> dict[int, int]:
    """The ranks ``mlx.launch`` started (in its process group): {rank: pid}."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == launcher.pid:
            continue
        try:
            if os.getpgid(int(entry.name)) != launcher.pid:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ProcessLookupError):
            continue
        ranks_of = [int(e[len(b"MLX_RANK=") :]) for e in environ if e.startswith(b"MLX_RANK=")]
        if ranks_of and b"mlxd" in (entry / "cmdline").read_bytes():
            found[ranks_of[0]] = int(entry.name)
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the ranks through /proc")
def test_under_mlx_launch_rank_0_exits_after_a_follower_dies_mid_stream(models, tmp_path):
    """``mlx.launch`` sends SIGTERM to the other ranks about a second after one dies,
    inside rank 0's ``exit_grace_s``: rank 0 still exits (its shutdown used to cancel the
    monitor, and then wait forever for its parked generation thread)."""
    with launched(tmp_path, models["qwen3"], "tensor") as d:
        launcher = d.procs[0]
        pids = _rank_pids(launcher)
        assert sorted(pids) == [0, 1], pids
        body = {"prompt": PROMPTS[0], "max_tokens": 4000, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{d.url}/v1/completions", json=body, timeout=30) as reply:
            lines = reply.iter_lines()
            for n, _ in enumerate(lines):
                if n == 3:
                    os.kill(pids[1], signal.SIGKILL)
                    break
            rest = list(lines)
        assert any("group of machines serving this model broke" in x for x in rest), rest
        launcher.wait(timeout=60)  # TimeoutExpired: rank 0 hangs, and mlx.launch with it
        assert not Path(f"/proc/{pids[0]}").exists()


def test_pipeline_parallel_hybrid_equals_mlx_lm_sharded(models, reference, tmp_path):
    with launched(tmp_path, models["qwen3_5"], "pipeline") as d:
        _check_serving(d, reference["qwen3_5"])
        assert "pipeline parallel" in d.log


def test_quantized_kv_over_two_ranks_equals_one_process(models, tmp_path):
    """``engine.kv_bits = 8`` on a pipeline-parallel hybrid: each rank quantizes its own
    attention layers' KV, and the two ranks' greedy output equals one process's with the
    same settings (pipeline parallel keeps every layer whole: the same math), alone,
    batched, aborted beside and from the prefix cache; both count the quantized bytes."""
    env = {"MLXD_ENGINE__KV_BITS": "8", "MLXD_ENGINE__KV_GROUP_SIZE": "32"}
    model = models["qwen3_5_hd32"]
    port = _free_ports(1)
    serve = [str(BIN / "mlxd"), "serve", str(model), "--port", str(port)]
    one = Daemon([_start(serve, tmp_path / "one.log", env)], f"http://127.0.0.1:{port}", [])
    one.logs = [tmp_path / "one.log"]
    try:
        one.wait_ready()
        want = [one.complete(p) for p in PROMPTS]
        alone_status = httpx.get(f"{one.url}/v1/status", timeout=10).json()
    finally:
        _stop(one.procs)
    # 2 attention layers x (keys + values) x 2 KV heads x 32 values: 1 byte each at 8
    # bits, and a float32 scale and bias per 32 values (full precision: 4 bytes each)
    values = 2 * 2 * 2 * 32
    assert alone_status["memory"]["kv_bytes_per_token"] == values + values // 32 * 2 * 4
    with launched(tmp_path, model, "pipeline", env) as d:
        _check_serving(d, want)
        status = httpx.get(f"{d.url}/v1/status", timeout=10).json()
        assert "pipeline parallel" in d.log
    # rank 0 holds (and its memory gate counts) one of the two attention layers
    assert (
        status["memory"]["kv_bytes_per_token"] == alone_status["memory"]["kv_bytes_per_token"] // 2
    )


def _refused(d: Daemon) -> list[str]:
    """Both ranks exit non-zero; each rank's one start-up error line."""
    codes = [p.wait(timeout=90) for p in d.procs]
    assert all(c != 0 for c in codes), (codes, d.log[-3000:])
    assert "Traceback" not in d.log, d.log[-3000:]
    return [line for line in d.log.splitlines() if "start-up failed" in line]


def test_a_model_that_cannot_be_sharded_is_refused_in_one_line(models, tmp_path):
    with ranks(tmp_path, models["baichuan_m1"]) as d:
        errors = _refused(d)
    assert len(errors) == 2, errors
    assert all("supports neither tensor parallel" in e for e in errors), errors


def test_ranks_with_different_settings_refuse_to_start(models, tmp_path):
    other = {"MLXD_ENGINE__MAX_BATCH": "3"}
    with ranks(tmp_path, models["qwen3"], ({}, other)) as d:
        errors = _refused(d)
    assert len(errors) == 2, errors
    assert all("rank(s) 1 do not hold the same settings as rank 0" in e for e in errors)
