"""An agent session across a daemon restart: turn-4 TTFT with the disk tier against cold.

One agent conversation: a system prompt of about ``--system-tokens`` tokens (bench_agents'
tool manual, followed by repository files and logs from its tool-output generators, as an
agent's context holds them) and three turns of tool output, each reply (``--max-tokens``
greedy tokens) appended to the history. Then the daemon is stopped with SIGTERM (mlxd
writes its prefix-cache snapshots to ``prefix_cache.disk_dir``) and started again with
the same settings, and turn 4 is sent: its TTFT is the number this script is about.
In the same run, for comparison, the same turn-4 request goes to:

- ``cold``: a fresh mlxd with empty tiers (a new, empty ``disk_dir``);
- ``mlx_lm.server`` taken through the same session and restarted the same way (SIGTERM,
  start); it keeps no cache across a restart.

Every server gets the same messages: the replies in the history are mlxd's turn-1..3
replies, so turn 4 is byte-identical everywhere. TTFT is measured on the stream (first
content delta). Both servers are warmed up with one short request after each start.

    python -m mlxd.scripts.bench_restart                        # SmolLM2, 6,800-token system prompt
    python -m mlxd.scripts.bench_restart --model hybrid
    python -m mlxd.scripts.bench_restart --model default,hybrid --system-tokens 6800

``default`` and ``hybrid`` are bench_agents' models (SmolLM2-135M-Instruct as float32;
the random-weight Qwen3.5-architecture hybrid of SmolLM2's compute).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from mlxd.scripts.bench_agents import (
    ROOT,
    Turn,
    _code,
    _logs,
    _revision,
    _tail,
    chat,
    command,
    free_port,
    prepare,
    tool_manual,
    tool_outputs,
    wait_ready,
)

TURNS = 4


def system_prompt(tokenizer, target: int) -> str:
    """The tool manual, then repository files and test logs, up to ``target`` tokens."""
    rng = random.Random("bench_restart")
    parts = [tool_manual(), "", "# Repository context (read at session start)"]
    i = 0
    while True:
        more = [
            f"\n## src/pkg_{i}/module.py\n{_code(rng, 1)}",
            f"\n## logs/run_{i}.log\n{_logs(rng, 2)}",
        ]
        if len(tokenizer.encode("\n".join(parts + more))) > target:
            return "\n".join(parts)
        parts += more
        i += 1


@dataclass
class Server:
    """A server subprocess that can be stopped with SIGTERM and started again."""

    kind: str  # "mlxd" or "mlx_lm"
    model_dir: Path
    log: Path
    timeout_s: float
    config: Path | None = None
    proc: subprocess.Popen | None = None
    url: str = ""

    def start(self) -> float:
        port = free_port()
        cmd, env = command(self.kind, self.model_dir, port, self.config)
        with self.log.open("ab") as f:
            self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        return wait_ready(self.url, self.proc, self.log, self.timeout_s)

    def stop(self) -> float:
        """SIGTERM and wait for the exit (mlxd spills its snapshots to disk first)."""
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        t0 = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise SystemExit(f"{self.kind} did not stop on SIGTERM:\n{_tail(self.log)}") from None
        return time.perf_counter() - t0


def send(server: Server, messages: list[dict], max_tokens: int, n: int) -> tuple[Turn, str]:
    import httpx
    import trio

    async def one() -> tuple[Turn, str]:
        turn = Turn(agent=0, turn=n)
        async with httpx.AsyncClient(timeout=1800) as client:
            reply = await chat(client, server.url, messages, max_tokens, turn)
        return turn, reply

    turn, reply = trio.run(one)
    if turn.error or turn.ttft is None:
        raise SystemExit(f"{server.kind} turn {n} failed: {turn.error}\n{_tail(server.log)}")
    return turn, reply


def _config(path: Path, disk_dir: Path) -> Path:
    path.write_text(f'[prefix_cache]\ndisk_dir = "{disk_dir}"\n')
    return path


def _disk_bytes(disk_dir: Path) -> int:
    return sum(p.stat().st_size for p in disk_dir.rglob("*") if p.is_file())


def _line(label: str, turn: Turn) -> str:
    cached = "-" if turn.cached_tokens is None else turn.cached_tokens
    return (
        f"  {label:<34} TTFT {turn.ttft:7.2f} s  ({turn.prompt_tokens} prompt tokens, "
        f"{cached} cached)"
    )


def bench_model(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    from transformers import AutoTokenizer

    work = tmp / name
    work.mkdir(parents=True)
    model_dir, description = prepare(name, work)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    system = system_prompt(tokenizer, args.system_tokens)
    outputs = tool_outputs(0, TURNS)
    print(
        f"\nmodel {name}: {description}; system prompt {len(tokenizer.encode(system))} tokens, "
        f"{TURNS} turns, {args.max_tokens} tokens per reply, greedy",
        flush=True,
    )
    result: dict = {"model": name, "description": description}

    # mlxd: turns 1-3, SIGTERM, start with the same disk_dir, turn 4.
    disk = work / "disk"
    mlxd = Server("mlxd", model_dir, work / "mlxd.log", args.ready_timeout)
    mlxd.config = _config(work / "mlxd.toml", disk)
    messages = [{"role": "system", "content": system}]
    mlxd.start()
    try:
        for n in range(1, TURNS):
            messages.append({"role": "user", "content": outputs[n - 1]})
            turn, reply = send(mlxd, messages, args.max_tokens, n)
            print(_line(f"mlxd turn {n}", turn), flush=True)
            result[f"mlxd_turn{n}_ttft_s"] = turn.ttft
            messages.append({"role": "assistant", "content": reply})
        stop_s = mlxd.stop()
        print(
            f"  mlxd SIGTERM: stopped in {stop_s:.1f} s, {_disk_bytes(disk) / 2**20:.0f} MiB on disk"
        )
        load_s = mlxd.start()
        print(f"  mlxd started again (same disk_dir), ready in {load_s:.1f} s", flush=True)
        messages.append({"role": "user", "content": outputs[TURNS - 1]})
        restart, _ = send(mlxd, messages, args.max_tokens, TURNS)
        print(_line("mlxd turn 4 after restart", restart), flush=True)
    finally:
        mlxd.stop()

    # cold: the same turn-4 request on a fresh daemon with empty tiers.
    cold_server = Server("mlxd", model_dir, work / "cold.log", args.ready_timeout)
    cold_server.config = _config(work / "cold.toml", work / "disk-cold")
    cold_server.start()
    try:
        cold, _ = send(cold_server, messages, args.max_tokens, TURNS)
        print(_line("mlxd turn 4 cold (empty tiers)", cold), flush=True)
    finally:
        cold_server.stop()

    peer = None if args.no_mlx_lm else mlx_lm_session(model_dir, work, messages, args, result)

    result |= {
        "turn4_prompt_tokens": restart.prompt_tokens,
        "restart_ttft_s": restart.ttft,
        "restart_cached_tokens": restart.cached_tokens,
        "cold_ttft_s": cold.ttft,
        "restart_over_cold": restart.ttft / cold.ttft,
    }
    print(
        f"  turn-4 TTFT after restart / cold: {restart.ttft / cold.ttft:.3f} "
        f"(target at most 0.1: {'met' if restart.ttft <= 0.1 * cold.ttft else 'NOT met'})"
    )
    if peer is not None:
        result |= {
            "mlx_lm_restart_ttft_s": peer.ttft,
            "mlx_lm_over_mlxd": peer.ttft / restart.ttft,
        }
        print(
            f"  mlx_lm.server turn 4 after restart / mlxd turn 4 after restart: "
            f"x{peer.ttft / restart.ttft:.1f}"
        )
    return result


def mlx_lm_session(
    model_dir: Path, work: Path, messages: list[dict], args: argparse.Namespace, result: dict
) -> Turn:
    """mlx_lm.server taken through the same turns (mlxd's replies in the history),
    stopped with SIGTERM and started again: its turn 4."""
    lm = Server("mlx_lm", model_dir, work / "mlx_lm.log", args.ready_timeout)
    lm.start()
    try:
        for n in range(1, TURNS):
            turn, _ = send(lm, messages[: 2 * n], args.max_tokens, n)
            print(_line(f"mlx_lm.server turn {n}", turn), flush=True)
            result[f"mlx_lm_turn{n}_ttft_s"] = turn.ttft
        lm.stop()
        lm.start()
        peer, _ = send(lm, messages, args.max_tokens, TURNS)
        print(_line("mlx_lm.server turn 4 after restart", peer), flush=True)
        return peer
    finally:
        lm.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_restart", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default="default", help="default, hybrid, DIR or FILE.gguf; a comma list"
    )
    p.add_argument(
        "--system-tokens",
        type=int,
        default=6800,
        help="system prompt size in tokens (6800: turn 4 is about 8,100 tokens, within SmolLM2's 8,192)",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per reply")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to load a model")
    p.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx_lm.server comparison")
    p.add_argument("--keep", action="store_true", help="keep the logs and disk tier, say where")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import importlib.metadata

    print(
        f"mlxd {_revision()}, mlx-lm {importlib.metadata.version('mlx-lm')}, "
        f"mlx {importlib.metadata.version('mlx')}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    tmp = Path(tempfile.mkdtemp(prefix="bench_restart."))
    try:
        results = [bench_model(name, args, tmp) for name in args.model.split(",")]
    finally:
        if args.keep:
            print(f"logs and tiers kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
    from mlxd.scripts import records  # docs/benchmarks.md is rendered from the records

    rows = [
        records.compared(f"{r['model']}, turn 4 after a restart", "TTFT", better="lower",
                         unit="s", mlxd=r["restart_ttft_s"], peer=r["mlx_lm_restart_ttft_s"])
        for r in results
        if "mlx_lm_restart_ttft_s" in r
    ]  # fmt: skip
    command = records.command(argv, module="mlxd.scripts.bench_restart")
    records.write("bench_restart", command=command, peer="mlx_lm.server", rows=rows,
                  figures=records.numbers(results))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
