"""The agent workload against one daemon and against two behind ``mlxd cluster``, in one run.

The workload is ``bench_agents.py``'s: K concurrent agents share a long system prompt
(a tool manual) and each holds a T-turn conversation whose history grows turn by turn.
It runs against (a) one daemon, (b) two daemons behind the router with ``round_robin``
and (c) the same two with ``cache_aware``. Both daemons start once; before each run
their prefix caches are cleared (``DELETE /v1/cache``). Prints per run the wall time,
TTFT p50/p95, failed requests, the prompt and cached tokens the daemons reported in
``usage``, the cached-token share, and how many requests each daemon served (from its
``/metrics``); then (c)'s and (b)'s cached share as a fraction of (a)'s.

On one machine both daemons share its cores, so wall time is not the point: the cached
share (what a conversation keeps when it lands where its prefix is) and failures are.

    python -m mlxd.scripts.bench_cluster                    # tiny random model, 8 x 5
    python -m mlxd.scripts.bench_cluster --model default --agents 4 --turns 3 --json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import trio
from mlxd.daemon.bench import percentile
from mlxd.scripts.bench_agents import ROOT, Turn, converted, free_port, prepare, serving, workload

WAIT_S = 600.0


def tiny_model(tmp: Path) -> Path:
    """The tests' tiny random-weight Llama with SmolLM2's tokenizer: fast prefill."""
    from mlxd.scripts.tiny_models import LLAMA, build_text_model

    return build_text_model(LLAMA, converted(), tmp / "tiny-llama")


def daemon_requests(url: str) -> float:
    """Requests a daemon has finished, from its ``/metrics``."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=WAIT_S).text.splitlines():
        if line.startswith("mlxd_requests_total{"):
            total += float(line.rpartition(" ")[2])
    return total


@contextmanager
def router(workers: list[str], policy: str, log: Path) -> Iterator[str]:
    """``mlxd cluster`` in front of ``workers``; yields its URL once it forwards."""
    port, metrics = free_port(), free_port()
    command = [sys.executable, "-m", "mlxd.daemon.cli", "cluster", "--policy", policy]
    command += [a for w in workers for a in ("--worker", w)]
    command += ["--port", str(port), "--metrics-port", str(metrics)]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_models(url, proc, log)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_models(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"router exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"router not serving after {WAIT_S:.0f} s")


def summary(name: str, wall: float, turns: list[Turn], served: list[float]) -> dict:
    ok = [t for t in turns if t.error is None and t.ttft is not None]
    ttft = [t.ttft for t in ok]
    prompt = sum(t.prompt_tokens for t in ok)
    cached = sum(t.cached_tokens or 0 for t in ok)
    return {
        "run": name,
        "wall_s": wall,
        "requests": len(turns),
        "failed": len(turns) - len(ok),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": cached / prompt if prompt else 0.0,
        "served_by_daemon": served,
        "errors": sorted({t.error for t in turns if t.error}),
    }


def one_run(name: str, url: str, daemons: list[str], args: argparse.Namespace) -> dict:
    for d in daemons:  # every run starts cold
        httpx.delete(f"{d}/v1/cache", timeout=WAIT_S).raise_for_status()
    before = [daemon_requests(d) for d in daemons]
    wall, turns = trio.run(workload, url, args.agents, args.turns, args.max_tokens)
    served = [daemon_requests(d) - b for d, b in zip(daemons, before, strict=True)]
    return summary(name, wall, turns, served)


def report(results: list[dict]) -> str:
    head = f"{'run':<28}{'wall_s':>7}{'failed':>7}{'ttft_p50':>9}{'ttft_p95':>9}"
    head += f"{'prompt':>8}{'cached':>8}{'share':>7}  served"
    lines = [head]
    for r in results:
        lines.append(
            f"{r['run']:<28}{r['wall_s']:>7.1f}{r['failed']:>7d}{r['ttft_p50_s']:>9.3f}"
            f"{r['ttft_p95_s']:>9.3f}{r['prompt_tokens']:>8d}{r['cached_tokens']:>8d}"
            f"{r['cached_share']:>7.1%}  {'/'.join(str(int(s)) for s in r['served_by_daemon'])}"
        )
    base = results[0]["cached_share"] or 1.0
    for r in results[1:]:
        lines.append(f"{r['run']}: cached share {r['cached_share'] / base:.2f} x one daemon's")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny (random weights), default, or a DIR")
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--json", action="store_true", help="print the results as JSON too")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        model = tiny_model(tmp) if args.model == "tiny" else prepare(args.model, tmp)[0]
        urls = [
            stack.enter_context(serving("mlxd", model, tmp / f"daemon-{i}.log", WAIT_S))[0]
            for i in range(2)
        ]
        results = [one_run("(a) one daemon", urls[0], urls[:1], args)]
        for label, policy in (("(b) two, round_robin", "round_robin"),
                              ("(c) two, cache_aware", "cache_aware")):  # fmt: skip
            with router(urls, policy, tmp / f"router-{policy}.log") as url:
                results.append(one_run(label, url, urls, args))
    print(f"{args.agents} agents x {args.turns} turns, max_tokens {args.max_tokens}, {args.model}")
    print(report(results))
    if args.json:
        print(json.dumps(results, indent=1))
    from mlxd.scripts import records  # docs/benchmarks.md is rendered from the records

    one = results[0]
    rows = [
        records.compared(r["run"], metric, better=better, mlxd=r[key], peer=one[key])
        for r in results[1:]
        for metric, key, better in (("cached-token share", "cached_share", "higher"),
                                    ("wall time (s)", "wall_s", "lower"))
    ]  # fmt: skip
    command = records.command(argv, module="mlxd.scripts.bench_cluster")
    records.write("bench_cluster", command=command, peer="one daemon", rows=rows,
                  figures=records.numbers(results))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
