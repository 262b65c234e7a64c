"""LoRA adapters chosen per request (issue 44): 8 adapters over one base in one batch,
against the base alone and against today's layout (one fused copy of the base per
adapter), in one run.

Three arms, one after another (``--rounds``, the order alternating from round to round so
a neighbour's load on a shared machine falls on every arm), each a fresh ``mlxd serve``
subprocess on a free loopback port (SmolLM2-135M-Instruct, mlxd's default model, unless
``--model`` names another):

- ``base``: the base alone, no adapters;
- ``adapters``: the base with ``--adapters`` random LoRA adapters (``[model] adapters``),
  each request's ``model`` naming one;
- ``entries``: today's layout, one ``[[models]]`` entry per adapter with that adapter
  fused at load (``adapter_path``), ``model_pool.max_loaded`` = their count: a whole copy
  of the base per adapter, each entry its own batch (the engine steps them in turn), as
  eight separate servers would hold eight copies.

Each arm answers one warm-up chat per model or adapter first (untimed: its start-up and
these loads are reported as ``load_s``), then the same ``adapters x per-adapter``
streaming greedy chats at once (``mlxd bench``'s rambling prompts, ``max_tokens``
each; mlxd has no ``ignore_eos``), request i to adapter (or entry) i mod adapters.
Per arm: aggregate tok/s (every completion token over the wall time from the first
request sent to the last done), TTFT p50 / p90, the daemon's resident set (VmRSS,
sampled every half second; its peak) and MLX's active memory (``/v1/status``
``memory.active_bytes``, sampled likewise; its peak), each also idle before the chats.
Printed per round and arm, then each ratio's median over the rounds. The adapters are random
(``scripts/tiny_models.build_lora_adapter``: rank 8, scale 2, on q / v / o and the MLP's
gate / up / down projections of every layer), so their answers differ from the base's:
the warm-up's answers to one prompt are counted as a light check that each adapter
applies.

Targets (the issue's): the adapters' memory within 1.1x of the base alone, their tok/s
at least 0.8x of the base alone and at least 2x of the entries'.

    python -m mlxd.scripts.bench_lora             # 8 adapters x 4 requests, 64 tokens, 2 rounds
    python -m mlxd.scripts.bench_lora --quick --no-record   # 16 tokens, one round: a smoke run

On the shared 2-core VM a round takes about 4.5 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import trio
from mlxd.daemon import bench
from mlxd.scripts import bench_agents

LORA_KEYS = (  # q / v / o and the MLP's projections, on every layer
    "self_attn.q_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
WARM_PROMPT = "Say hello."
TARGETS = {"memory": 1.1, "tok_s_base": 0.8, "tok_s_entries": 2.0}


@dataclass
class Arm:
    """One daemon's pass: its settings, the model id each request names, and results."""

    name: str
    config: str  # TOML
    ids: list[str | None]  # per adapter / entry: the request's "model" (None: none sent)
    load_s: float = 0.0
    summary: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    warm_answers: list[str] = field(default_factory=list)
    load_avg: tuple[float, float] = (0.0, 0.0)
    round: int = 0


# ---- adapters and arms ----------------------------------------------------------------


def adapter_source(model: str) -> Path:
    """The model directory the adapters are built against (mlx-lm's layout)."""
    if model == "" or model.endswith(".gguf"):
        return bench_agents.converted(Path(model) if model else None)
    return Path(model)


def build_adapters(model_dir: Path, out: Path, n: int, rank: int) -> list[Path]:
    """``n`` random LoRA adapters of ``rank`` on every layer, seeds 0 to n - 1."""
    from mlxd.scripts.tiny_models import build_lora_adapter

    config = json.loads((model_dir / "config.json").read_text())
    layers = config.get("num_hidden_layers") or config["text_config"]["num_hidden_layers"]
    return [
        build_lora_adapter(
            model_dir,
            out / f"a{i}",
            rank=rank,
            num_layers=layers,
            keys=LORA_KEYS,
            seed=i,
            spread=0.05,  # small, as a trained adapter's update is
        )
        for i in range(n)
    ]


def _toml(value: str) -> str:
    return json.dumps(value)  # a JSON string is a TOML basic string


def arms(model: str, dirs: list[Path], max_batch: int) -> list[Arm]:
    """The three arms' settings files and request targets."""
    engine = f"[engine]\nmax_batch = {max_batch}\n[admission]\nmax_running = {max_batch}\n"
    table = ", ".join(f"a{i} = {_toml(str(d))}" for i, d in enumerate(dirs))
    base = f"[model]\npath = {_toml(model)}\n"
    adapters = f"{base}adapters = {{ {table} }}\nmax_adapters = {len(dirs)}\n"
    entries = "".join(
        f'[[models]]\nid = "e{i}"\npath = {_toml(model)}\nadapter_path = {_toml(str(d))}\n'
        for i, d in enumerate(dirs)
    )
    pool = f"[model_pool]\nmax_loaded = {len(dirs)}\n"
    return [
        Arm("base", engine + base, [None] * len(dirs)),
        Arm("adapters", engine + adapters, [f"a{i}" for i in range(len(dirs))]),
        Arm("entries", engine + pool + entries, [f"e{i}" for i in range(len(dirs))]),
    ]


# ---- one daemon -----------------------------------------------------------------------


@contextlib.contextmanager
def daemon(config: Path, log: Path, timeout_s: float) -> Iterator[tuple[str, int]]:
    """``mlxd serve`` on a free port with ``config`` (which names the model); yields its
    URL and pid once it has answered a chat (``bench_agents.wait_ready``), stops it after."""
    port = bench_agents.free_port()
    args = ["serve", "--port", str(port), "--config", str(config)]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    with log.open("wb") as f:
        command = [sys.executable, "-m", "mlxd.daemon.cli", *args]
        proc = subprocess.Popen(
            command, env=env, cwd=bench_agents.ROOT, stdout=f, stderr=subprocess.STDOUT
        )
    try:
        url = f"http://127.0.0.1:{port}"
        bench_agents.wait_ready(url, proc, log, timeout_s)
        yield url, proc.pid
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def rss_bytes(pid: int) -> int:
    """The process's resident set (``/proc/PID/status`` VmRSS); 0 where there is none."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def warm_up(url: str, ids: list[str | None]) -> list[str]:
    """One short greedy chat per model id, in turn; their answers (loads happen here)."""
    import httpx

    answers = []
    for model in dict.fromkeys(ids):
        body = {"messages": [{"role": "user", "content": WARM_PROMPT}], "max_tokens": 16,
                "temperature": 0, **({"model": model} if model else {})}  # fmt: skip
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        response.raise_for_status()
        answers.append(response.json()["choices"][0]["message"]["content"])
    return answers


async def workload(url: str, pid: int, ids: list[str | None], per: int, max_tokens: int):
    """``per`` requests per id, all at once; (summary, memory peaks) while they ran."""
    import httpx

    n = len(ids) * per
    results: list[bench.RequestResult] = []
    peaks = {"rss_bytes": 0, "mlx_active_bytes": 0, "mlx_peak_bytes": 0}

    async def one(i: int, prompt: str) -> None:
        model = ids[i % len(ids)]
        extra = {"model": model} if model else None
        results.append(await bench.stream_one(client, url, prompt, max_tokens, extra))

    async def sample() -> None:
        while True:
            peaks["rss_bytes"] = max(peaks["rss_bytes"], rss_bytes(pid))
            memory = (await client.get(f"{url}/v1/status")).json()["memory"]
            peaks["mlx_active_bytes"] = max(peaks["mlx_active_bytes"], memory["active_bytes"])
            peaks["mlx_peak_bytes"] = max(peaks["mlx_peak_bytes"], memory["peak_bytes"])
            await trio.sleep(0.5)

    limits = httpx.Limits(max_connections=n + 4)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        idle = {"rss_idle_bytes": rss_bytes(pid)}
        status = (await client.get(f"{url}/v1/status")).json()["memory"]
        idle["mlx_idle_bytes"] = status["active_bytes"]  # weights (and adapters), no rows
        async with trio.open_nursery() as sampler:
            sampler.start_soon(sample)
            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i, prompt in enumerate(bench.prompts(n)):
                    nursery.start_soon(one, i, prompt)
            wall = time.perf_counter() - t0
            sampler.cancel_scope.cancel()
    level = bench.LevelResult("server", n, wall, results)
    ttfts = [r.ttft for r in level.ok if r.ttft is not None]
    summary = {**level.summary(), "ttft_p90_ms": 1000 * bench.percentile(ttfts, 90)}
    return summary, {**peaks, **idle}


def run_arm(arm: Arm, args: argparse.Namespace, tmp: Path) -> Arm:
    config = tmp / f"{arm.name}.toml"
    config.write_text(arm.config)
    before, t0 = os.getloadavg()[0], time.perf_counter()
    log = tmp / f"{arm.name}-{arm.round}.log"
    with daemon(config, log, args.ready_timeout) as (url, pid):
        arm.warm_answers = warm_up(url, arm.ids)
        arm.load_s = time.perf_counter() - t0
        arm.summary, arm.memory = trio.run(
            workload, url, pid, arm.ids, args.per_adapter, args.max_tokens
        )
    arm.load_avg = (before, os.getloadavg()[0])
    return arm


# ---- report ---------------------------------------------------------------------------


def by_round(done: list[Arm]) -> list[dict[str, Arm]]:
    """The rounds whose three arms all ran, each as {arm name: arm}."""
    rounds: dict[int, dict[str, Arm]] = {}
    for arm in done:
        rounds.setdefault(arm.round, {})[arm.name] = arm
    return [r for _, r in sorted(rounds.items()) if {"base", "adapters", "entries"} <= r.keys()]


def ratios(by: dict[str, Arm]) -> dict[str, float]:
    """adapters over base (memory, tok/s, TTFT) and over entries; entries over base memory."""
    a, b, e = by["adapters"], by["base"], by["entries"]
    out = {}
    for key in ("rss_bytes", "mlx_active_bytes", "mlx_idle_bytes"):
        out[f"adapters/base {key}"] = a.memory[key] / b.memory[key]
        out[f"entries/base {key}"] = e.memory[key] / b.memory[key]
    out["adapters/entries rss_bytes"] = a.memory["rss_bytes"] / e.memory["rss_bytes"]
    out["adapters/base tok_s"] = a.summary["tok_s"] / b.summary["tok_s"]
    out["adapters/entries tok_s"] = a.summary["tok_s"] / e.summary["tok_s"]
    out["adapters/base ttft_p50"] = a.summary["ttft_p50_ms"] / b.summary["ttft_p50_ms"]
    out["adapters/entries ttft_p50"] = a.summary["ttft_p50_ms"] / e.summary["ttft_p50_ms"]
    return out


def over_rounds(done: list[Arm]) -> dict[str, list[float]]:
    """Each ratio, one value per complete round."""
    out: dict[str, list[float]] = {}
    for by in by_round(done):
        for key, value in ratios(by).items():
            out.setdefault(key, []).append(value)
    return out


def verdicts(r: dict[str, float]) -> list[tuple[str, float, str, bool]]:
    """(what, measured, target, met) for the issue's targets."""
    m, t1, t2 = TARGETS["memory"], TARGETS["tok_s_base"], TARGETS["tok_s_entries"]
    checks = (
        ("resident memory, adapters / base", "adapters/base rss_bytes", m, False),
        ("MLX active memory, adapters / base", "adapters/base mlx_active_bytes", m, False),
        ("tok/s, adapters / base", "adapters/base tok_s", t1, True),
        ("tok/s, adapters / entries", "adapters/entries tok_s", t2, True),
    )
    return [
        (what, r[key], f"{'>=' if up else '<='} {t}", r[key] >= t if up else r[key] <= t)
        for what, key, t, up in checks
    ]


def changed(arm: Arm, done: list[Arm]) -> str:
    """How many of the arm's warm-up answers differ from the base's (an adapter applied)."""
    base = next((a.warm_answers[0] for a in done if a.name == "base"), None)
    if base is None:
        return "-"
    return f"{sum(answer != base for answer in arm.warm_answers)}/{len(arm.warm_answers)}"


def table(arms_run: list[Arm], done: list[Arm]) -> list[str]:
    mb = 2**20
    lines = [
        f"{'round':>5} {'arm':>8} {'load s':>7} {'ok':>3} {'fail':>4} {'tokens':>6} "
        f"{'wall s':>6} {'tok/s':>6} {'ttft50':>7} {'ttft90':>7} {'RSS MB':>6} {'idle':>5} "
        f"{'MLX MB':>6} {'idle':>5} {'changed':>7} {'load avg':>9}"
    ]
    for arm in arms_run:
        s, m = arm.summary, arm.memory
        lines.append(
            f"{arm.round:>5} {arm.name:>8} {arm.load_s:>7.1f} {s['ok']:>3} {s['failed']:>4} "
            f"{s['tokens']:>6} {s['wall_s']:>6.1f} {s['tok_s']:>6.1f} "
            f"{s['ttft_p50_ms'] / 1000:>6.2f}s {s['ttft_p90_ms'] / 1000:>6.2f}s "
            f"{m['rss_bytes'] / mb:>6.0f} {m['rss_idle_bytes'] / mb:>5.0f} "
            f"{m['mlx_active_bytes'] / mb:>6.0f} {m['mlx_idle_bytes'] / mb:>5.0f} "
            f"{changed(arm, done):>7} {arm.load_avg[0]:>4.1f}-{arm.load_avg[1]:<4.1f}"
        )
        lines += [f"{'':>14} error: {e}" for e in s["errors"][:3]]
    return lines


def report(done: list[Arm]) -> str:
    lines = table(done, done)
    values = over_rounds(done)
    if not values:
        return "\n".join(lines)
    for key, each in values.items():
        spread = ", ".join(f"{v:.2f}" for v in each)
        lines.append(f"{key}: median {statistics.median(each):.2f} ({spread})")
    medians = {key: statistics.median(each) for key, each in values.items()}
    lines += [f"{what}: {v:.2f} (target {t}) {'met' if ok else 'MISSED'}"
              for what, v, t, ok in verdicts(medians)]  # fmt: skip
    return "\n".join(lines)


# ---- command line ---------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help='a model dir or .gguf; "" = SmolLM2 (default)')
    p.add_argument("--adapters", type=int, default=8, help="adapters (and entries)")
    p.add_argument("--per-adapter", type=int, default=4, help="requests per adapter")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="rounds, the arms' order alternating")
    p.add_argument("--quick", action="store_true", help="16 tokens, one round (a smoke run)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--no-record", action="store_true", help="print only; no docs/results")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.max_tokens, args.rounds = min(args.max_tokens, 16), 1
    n = args.adapters * args.per_adapter
    done: list[Arm] = []
    with tempfile.TemporaryDirectory(prefix="mlxd-bench-lora-") as name:
        tmp = Path(name)
        source = adapter_source(args.model)
        dirs = build_adapters(source, tmp / "adapters", args.adapters, args.rank)
        when = time.strftime("%Y-%m-%d %H:%M")
        print(f"{args.adapters} adapters (rank {args.rank}) x {args.per_adapter} requests, "
              f"{args.max_tokens} tokens; {when}", flush=True)  # fmt: skip
        plan = arms(args.model, dirs, max(n, 32))
        for r in range(args.rounds):  # alternating: a neighbour's load falls on every arm
            for arm in plan if r % 2 == 0 else plan[::-1]:
                done.append(run_arm(dataclasses.replace(arm, round=r), args, tmp))
                print("\n".join(table(done[-1:], done)[1:]), flush=True)
    print(report(done))
    if not args.no_record and by_round(done):
        _record(done, args, argv)
    return 1 if any(a.summary["failed"] for a in done) else 0


def notes(done: list[Arm]) -> str:
    """What the arms were, the targets met or missed, the loads and the machine's load."""
    values = over_rounds(done)
    medians = {key: statistics.median(each) for key, each in values.items()}
    n = len(done[0].ids)
    met = "; ".join(
        f"{what} {v:.2f} (target {t}: {'met' if ok else 'missed'})"
        for what, v, t, ok in verdicts(medians)
    )
    loads = ", ".join(
        f"{name} {statistics.median(a.load_s for a in done if a.name == name):.0f} s"
        for name in ("base", "adapters", "entries")
    )
    busy = [x for a in done for x in a.load_avg]
    return (
        f"Three arms, each a fresh daemon: the base alone; {n} random LoRA adapters over it, "
        f"chosen per request and decoded in one batch; today's layout, {n} [[models]] "
        f"entries each with one adapter fused at load ({n} copies of the base, as {n} "
        f"separate servers would hold them; the engine steps each entry's batch in turn). "
        f"Medians over {len(values['adapters/base tok_s'])} rounds, the arms' order "
        f"alternating: {met}. MLX active memory idle (weights and adapters, no rows): "
        f"adapters / base {medians['adapters/base mlx_idle_bytes']:.2f}, entries / base "
        f"{medians['entries/base mlx_idle_bytes']:.2f}; at the run's peak the rows' KV "
        f"cache and activations dilute both. Start-up and one warm-up chat per model or "
        f"adapter (not timed), median: {loads}. The machine's load average ran "
        f"{min(busy):.1f} to {max(busy):.1f} (on {os.cpu_count()} cores; the daemon's own "
        f"threads count)."
    )


def _record(done: list[Arm], args: argparse.Namespace, argv: list[str] | None) -> None:
    """The run as a record in docs/results: the median ratios as compared rows, per round
    and arm its figures."""
    from mlxd.scripts import records

    values = over_rounds(done)
    med = {key: statistics.median(each) for key, each in values.items()}
    n = args.adapters
    rows = [
        records.compared(f"{n} adapters / base alone", metric, better=better, ratio=med[key])
        for metric, key, better in (
            ("resident memory", "adapters/base rss_bytes", "lower"),
            ("MLX active memory", "adapters/base mlx_active_bytes", "lower"),
            ("tok/s", "adapters/base tok_s", "higher"),
        )
    ] + [
        records.compared(f"{n} adapters / {n} entries", metric, better=better, ratio=med[key])
        for metric, key, better in (
            ("resident memory", "adapters/entries rss_bytes", "lower"),
            ("tok/s", "adapters/entries tok_s", "higher"),
        )
    ]
    figures = {}
    for arm in done:
        at = f"round {arm.round} {arm.name}"
        figures[f"{at} load_s"] = arm.load_s
        for key in ("tok_s", "ttft_p50_ms", "ttft_p90_ms", "tokens", "failed"):
            figures[f"{at} {key}"] = arm.summary[key]
        for key, value in arm.memory.items():
            figures[f"{at} {key.replace('_bytes', '_mib')}"] = value / 2**20
    spread = "; ".join(
        f"{key} {min(values[key]):.2f}-{max(values[key]):.2f}"
        for key in ("adapters/base tok_s", "adapters/entries tok_s", "adapters/base rss_bytes")
    )
    command = records.command(argv, module="mlxd.scripts.bench_lora")
    records.write(
        "bench_lora",
        command=command,
        rows=rows,
        figures=figures,
        notes=notes(done),
        peer=f"the base alone; {n} [[models]] entries, one fused adapter each",
        against="itself",
        model=args.model or "SmolLM2-135M-Instruct, float32 from its Q4_1 GGUF",
        weights="real base, random adapters",
        samples=f"{n * args.per_adapter} chats of {args.max_tokens} tokens per arm and round, "
        f"{len(values['adapters/base tok_s'])} rounds",
        spread=f"over the rounds: {spread}; TTFT p90 beside p50 in the figures",
    )


if __name__ == "__main__":
    sys.exit(main())
