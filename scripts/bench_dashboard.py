"""What the dashboard costs: decode throughput with the page open and polling, against
it closed, on one ``mlxd serve`` in one run.

Each round sends C concurrent short streaming greedy chats (``bench_chat``'s prompts and
client) twice: once with no page open, once with the dashboard open in headless Chromium
(Debian's ``chromium`` driven by ``playwright``), polling ``/v1/dashboard`` as a user's tab
does. Rounds alternate which comes first, so a neighbour's load on a shared machine falls
on both. Prints per round each side's tok/s (generated tokens over the wall time) and
inter-token gap p50, the ratio open / closed (1.0: no cost), the load average, and the
median ratio over the rounds. The browser runs on the same machine: its own CPU use is
part of what is measured, as on a laptop serving itself.

    python -m mlxd.scripts.bench_dashboard                          # C=8, 64 tokens, 3 rounds
    python -m mlxd.scripts.bench_dashboard --rounds 2 --max-tokens 128
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
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


def measure(url: str, args, tag: str) -> dict:
    prompts = bench_chat.chat_prompts(args.concurrency, tag)
    return trio.run(bench_chat.chats, url, prompts, args.max_tokens, args.timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="a model dir or .gguf (SmolLM2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    ratios, failed = [], 0
    with tempfile.TemporaryDirectory(prefix="mlxd-bench-dashboard-") as tmp:
        model_dir, label = bench_agents.prepare(args.model, Path(tmp))
        print(f"model: {label}; C={args.concurrency}, max_tokens={args.max_tokens}; "
              f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)  # fmt: skip
        log = Path(tmp) / "mlxd.log"
        with bench_agents.serving("mlxd", model_dir, log, args.ready_timeout) as (url, _):
            measure(url, args, "warm-up")
            for r in range(args.rounds):
                runs = {}
                for side in ("closed", "open") if r % 2 == 0 else ("open", "closed"):
                    load = os.getloadavg()[0]
                    if side == "open":
                        with dashboard_open(url):
                            time.sleep(2)  # its first polls (the whole history) are done
                            runs[side] = measure(url, args, f"{r}.{side}")
                    else:
                        runs[side] = measure(url, args, f"{r}.{side}")
                    runs[side]["load"] = load
                    failed += runs[side]["failed"]
                ratio = runs["open"]["tok_s"] / runs["closed"]["tok_s"]
                ratios.append(ratio)
                print(
                    f"round {r}: "
                    + "; ".join(
                        f"{side} {s['tok_s']:.1f} tok/s, gap p50 {s['itl_p50_ms']:.1f} ms "
                        f"(load {s['load']:.1f})"
                        for side, s in runs.items()
                    )
                    + f"; open / closed {ratio:.3f}",
                    flush=True,
                )
    print(f"median open / closed: {statistics.median(ratios):.3f} over {len(ratios)} rounds")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
