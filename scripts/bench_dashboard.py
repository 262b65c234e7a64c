"""What the dashboard costs: decode throughput with the page open and polling, against
it closed, on one ``mlxd serve`` in one run.

Each round sends C concurrent short streaming greedy chats (``bench_chat``'s prompts and
client) twice: once with no page open, once with the dashboard open in headless Chromium
(Debian's ``chromium`` driven by ``playwright``), polling ``/v1/dashboard`` as a user's tab
does. Rounds alternate which comes first, so a neighbour's load on a shared machine falls
on both. Prints per round each side's tok/s (generated tokens over the wall time),
inter-token gap p50, the daemon's CPU time per generated token (from /proc: a neighbour's
load slows the daemon down but adds little to its own CPU time, so this is the steadier
figure on a shared machine), the browser's CPU use, the ratios open / closed (1.0: no
cost), the load average, and the median ratios over the rounds. The browser runs on the
same machine: its CPU use competes with the daemon's, as on a laptop serving itself.
First, with no requests, it measures the daemon's and the browser's CPU use with the page
closed and then open (``--idle-s``): the dashboard's own cost, free of the load's noise.

    python -m mlxd.scripts.bench_dashboard                          # C=8, 64 tokens, 3 rounds
    python -m mlxd.scripts.bench_dashboard --rounds 2 --max-tokens 128
    python -m mlxd.scripts.bench_dashboard --client http    # the polls alone, no browser
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import trio
from mlxd.scripts import bench_agents, bench_chat


@contextlib.contextmanager
def dashboard_open(url: str) -> Iterator[None]:
    """The dashboard in a headless Chromium tab for the duration, polling."""
    from playwright.sync_api import sync_playwright

    preload = os.environ.pop("LD_PRELOAD", None)  # OpenBLAS in node: no thread creation
    try:
        p = sync_playwright().start()
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload
    try:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1200})
        page.goto(url + "/")
        page.wait_for_selector("#models tbody tr")
        yield
        browser.close()
    finally:
        p.stop()


@contextlib.contextmanager
def dashboard_polled(url: str, period_s: float = 1.0) -> Iterator[None]:
    """What the page asks of the server, without a browser: ``/v1/dashboard`` polled with
    its cursors every ``period_s`` from a thread."""
    import httpx

    stop = threading.Event()

    def poll() -> None:
        since = recent = 0
        with httpx.Client(timeout=60) as client:
            while not stop.wait(period_s):
                view = client.get(f"{url}/v1/dashboard?since={since}&recent_since={recent}")
                body = view.json()
                since, recent = body["next_sample"], body["next_recent"]

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


IDLE_BEFORE_S = 3.0  # longer than the default memory.release_after_idle_s


def _processes() -> dict[int, tuple[int, float, str]]:
    """Every process: pid → (parent pid, CPU seconds used, command line)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
        out[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, cmdline)
    return out


def cpu_seconds(port: int) -> tuple[float, float]:
    """CPU seconds used so far by the daemon serving on ``port``, and by the browsers this
    process started (Chromium and playwright's driver, all of this process's descendants)."""
    procs = _processes()
    server = sum(c for _, c, cmd in procs.values() if f"--port {port}" in cmd and " serve " in cmd)
    mine, browser = {os.getpid()}, 0.0
    for _ in range(8):  # descendants, a generation at a time
        mine |= {pid for pid, (parent, _, _) in procs.items() if parent in mine}
    for pid in mine - {os.getpid()}:
        parent, cpu, cmd = procs[pid]
        if " serve " not in cmd:
            browser += cpu
    return server, browser


def measure(url: str, args, tag: str) -> dict:
    """One pass of C chats, with the CPU the daemon (and any browser) used during it."""
    port = int(url.rpartition(":")[2])
    prompts = bench_chat.chat_prompts(args.concurrency, tag)
    server0, browser0 = cpu_seconds(port)
    summary = trio.run(bench_chat.chats, url, prompts, args.max_tokens, args.timeout)
    server1, browser1 = cpu_seconds(port)
    summary["server_cpu_per_token_ms"] = 1000 * (server1 - server0) / max(summary["tokens"], 1)
    summary["browser_cpu_s_per_s"] = (browser1 - browser0) / summary["wall_s"]
    return summary


def idle_cost(url: str, args) -> str:
    """The daemon's and the browser's CPU use over ``--idle-s`` with no requests, the page
    closed and then open: what the polls and the redraws cost, free of any load's noise."""
    port, seconds, used = int(url.rpartition(":")[2]), args.idle_s, {}
    for side in ("closed", "open"):
        opened = dashboard_open if args.client == "browser" else dashboard_polled
        with opened(url) if side == "open" else contextlib.nullcontext():
            time.sleep(3)  # past the warm-up's idle release, or the first (whole) poll
            server0, browser0 = cpu_seconds(port)
            time.sleep(seconds)
            server1, browser1 = cpu_seconds(port)
        used[side] = (1000 * (server1 - server0) / seconds, 1000 * (browser1 - browser0) / seconds)
    return (
        f"idle {seconds:g} s: daemon CPU {used['closed'][0]:.1f} ms/s closed, "
        f"{used['open'][0]:.1f} ms/s open; {args.client} CPU {used['open'][1]:.1f} ms/s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="a model dir or .gguf (SmolLM2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument(
        "--client",
        choices=("browser", "http"),
        default="browser",
        help="open: the page in headless Chromium, or only its polls (no browser's CPU)",
    )
    parser.add_argument("--idle-s", type=float, default=20.0, help="0: no idle measurement")
    args = parser.parse_args(argv)
    ratios, cpu_ratios, failed = [], [], 0
    with tempfile.TemporaryDirectory(prefix="mlxd-bench-dashboard-") as tmp:
        model_dir, label = bench_agents.prepare(args.model, Path(tmp))
        print(f"model: {label}; C={args.concurrency}, max_tokens={args.max_tokens}; "
              f"open = {args.client}; {time.strftime('%Y-%m-%d %H:%M')}", flush=True)  # fmt: skip
        log = Path(tmp) / "mlxd.log"
        with bench_agents.serving("mlxd", model_dir, log, args.ready_timeout) as (url, _):
            measure(url, args, "warm-up")
            if args.idle_s > 0:
                print(idle_cost(url, args), flush=True)
            for r in range(args.rounds):
                runs = {}
                for side in ("closed", "open") if r % 2 == 0 else ("open", "closed"):
                    load = os.getloadavg()[0]
                    # Both sides start the same way: idle past memory.release_after_idle_s
                    # (2 s), so each first step allocates afresh (a pause on one side only
                    # once cost that side ~6%); the page's first polls are done by then.
                    if side == "open":
                        opened = dashboard_open if args.client == "browser" else dashboard_polled
                        with opened(url):
                            time.sleep(IDLE_BEFORE_S)
                            runs[side] = measure(url, args, f"{r}.{side}")
                    else:
                        time.sleep(IDLE_BEFORE_S)
                        runs[side] = measure(url, args, f"{r}.{side}")
                    runs[side]["load"] = load
                    failed += runs[side]["failed"]
                ratio = runs["open"]["tok_s"] / runs["closed"]["tok_s"]
                cpu = (
                    runs["open"]["server_cpu_per_token_ms"]
                    / runs["closed"]["server_cpu_per_token_ms"]
                )
                ratios.append(ratio)
                cpu_ratios.append(cpu)
                print(
                    f"round {r}: "
                    + "; ".join(
                        f"{side} {s['tok_s']:.1f} tok/s, gap p50 {s['itl_p50_ms']:.1f} ms, "
                        f"daemon CPU {s['server_cpu_per_token_ms']:.1f} ms/token, "
                        f"browser CPU {s['browser_cpu_s_per_s']:.2f} s/s (load {s['load']:.1f})"
                        for side, s in runs.items()
                    )
                    + f"; open / closed: tok/s {ratio:.3f}, daemon CPU per token {cpu:.3f}",
                    flush=True,
                )
    print(
        f"median open / closed over {len(ratios)} rounds: tok/s {statistics.median(ratios):.3f}, "
        f"daemon CPU per token {statistics.median(cpu_ratios):.3f}"
    )
    from mlxd.scripts import records  # docs/benchmarks.md is rendered from the records

    rows = [records.compared(f"page open ({args.client})", "decode tok/s, median",
                             better="higher", ratio=statistics.median(ratios))]  # fmt: skip
    figures = {"daemon CPU per token, open / closed, median": statistics.median(cpu_ratios)}
    command = records.command(argv, module="mlxd.scripts.bench_dashboard")
    records.write("bench_dashboard", command=command, peer="the page closed", rows=rows,
                  figures=figures)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
