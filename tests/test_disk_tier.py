"""The prefix cache's disk tier: files that survive restarts, kills, evictions and unloads.

The store (``disk_tier``, no mlx) is tested by hand: budget, checksums, torn writes,
incompatible spaces, a disk that cannot be written, and a writer process killed at 20
random moments. The codec round-trips every mlx-lm cache kind bit for bit. One daemon
serving SmolLM2, a GatedDeltaNet hybrid and a sliding-window model (``max_loaded = 1``,
so every switch unloads) is restarted with SIGTERM and with ``kill -9``: the next turns
are disk hits whose greedy output equals a cold run's. Blocks (a growing conversation writes
each once, shared ones counted once, a corrupt one a miss, names recounted at start-up)
and write-behind (a `kill -9` keeps the conversation) are tested by hand and on a daemon.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from mlxd.actors.engine.runner import disk_tier
from mlxd.actors.engine.runner.disk_tier import DiskStore, Encoded

from tests.processes import free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 300.0  # a hang, not a slow machine


# ---- the store, by hand (no mlx) --------------------------------------------------------


def _payload(tokens: tuple[int, ...], size: int) -> bytes:
    seed = hashlib.sha256(repr(tokens).encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def _enc(tokens: tuple[int, ...], size: int = 4096) -> Encoded:
    data = _payload(tokens, size)
    return Encoded(
        [{"c": "fake", "state": {"a": "uint8", "s": [size], "o": 0, "n": size}}], [data], size
    )


def _store(root: Path, max_bytes: int = 1 << 20, models=("m",)) -> DiskStore:
    store = DiskStore(root, max_bytes, models, fsync=False)
    store.scanned.result()
    return store


def _read_all(store: DiskStore, space: str) -> dict[tuple[int, ...], bytes]:
    """Every entry the store would serve, read back through its checks."""
    out = {}
    with store._lock:
        entries = list(store._spaces.get(space, disk_tier._Space()).entries.values())
    for entry in entries:
        loaded = store.read(entry).result()
        if loaded is not None:
            out[entry.tokens] = bytes(loaded.payload)
    return out


def _disk_bytes(root: Path) -> int:
    """The snapshot files' bytes (the owner's lock file, a pid, is not a snapshot)."""
    return sum(
        p.stat().st_size for p in root.rglob("*") if p.is_file() and p.name != disk_tier.LOCK
    )


def test_budget_holds_over_many_inserts_and_lru_order(tmp_path):
    store = _store(tmp_path, max_bytes=40_000)
    view = store.space("m", {"k": 1})
    for i in range(60):
        view.spill(tuple(range(i * 100, i * 100 + 70)), False, _enc((i,), 4096))
        if i % 7 == 0:
            store.flush()
            assert _disk_bytes(tmp_path) <= 40_000
    store.flush()
    c = store.counters()
    assert 0 < c.bytes <= 40_000 and c.evictions > 0 and c.entries < 60
    assert _disk_bytes(tmp_path) == c.bytes
    # the newest survive; a rebuilt index keeps the budget too
    kept = set(_read_all(store, view.space))
    assert tuple(range(5900, 5970)) in kept and tuple(range(0, 70)) not in kept
    store.close()
    smaller = DiskStore(tmp_path, 20_000, ["m"], fsync=False)
    smaller.scanned.result()
    assert _disk_bytes(tmp_path) <= 20_000 and smaller.counters().evictions > 0


def test_matching_follows_the_ram_tier_rules(tmp_path):
    store = _store(tmp_path)
    view = store.space("m", {"k": 1})
    exact, trim = tuple(range(200)), tuple(range(1000, 1300))
    view.spill(exact, False, _enc(exact))
    view.spill(trim, True, _enc(trim))
    store.flush()
    assert view.best(exact + (7, 8), 201)[1] == 200  # a whole prefix: served
    assert view.best(exact[:150] + (9,) * 60, 209) is None  # exact-length: not a prefix
    assert view.best(trim[:130] + (9,) * 60, 189)[1] == 130  # trimmable: any prefix
    # a longer trimmable file covers a shorter one: not written again, and replaces it
    longer = trim + (5, 6, 7)
    view.spill(longer, True, _enc(longer))
    store.flush()
    assert view.spill(trim, True, _enc(trim)) and store.counters().entries == 2


def test_corrupt_truncated_and_torn_files_are_counted_removed_never_served(tmp_path):
    store = _store(tmp_path)
    view = store.space("m", {"k": 1})
    keys = [tuple(range(i, i + 90)) for i in range(6)]
    for k in keys:
        view.spill(k, False, _enc(k))
    store.flush()
    store.close()
    files = sorted((tmp_path / view.space).glob("*.kv"))
    files[0].write_bytes(files[0].read_bytes()[:-100])  # truncated
    data = bytearray(files[1].read_bytes())
    data[-10] ^= 0xFF  # a flipped payload byte: only a read sees it
    files[1].write_bytes(bytes(data))
    data = bytearray(files[2].read_bytes())
    data[20] ^= 0xFF  # a flipped header byte
    files[2].write_bytes(bytes(data))
    (tmp_path / view.space / "abc.tmp").write_bytes(b"half a file")  # a crash mid-write
    store = _store(tmp_path)
    view = store.space("m", {"k": 1})
    c = store.counters()
    assert c.corrupt_removed == 2 and c.torn_removed == 1 and c.entries == 4
    served = _read_all(store, view.space)
    assert store.counters().corrupt_removed == 3 and len(served) == 3
    for k, payload in served.items():
        assert payload == _payload(k, 4096)  # byte-identical, or not served at all
    assert len(list((tmp_path / view.space).iterdir())) == 3


def test_incompatible_spaces_are_never_used_and_cleaned(tmp_path):
    store = _store(tmp_path, models=("m", "gone"))
    old = store.space("m", {"template": "a", "kv_bits": 0})
    other = store.space("gone", {"template": "a"})
    k = tuple(range(100))
    old.spill(k, False, _enc(k))
    other.spill(k, False, _enc(k))
    store.flush()
    store.close()
    (tmp_path / "junk").write_text("not ours")
    # a file of another format version in the right place
    header = old.space
    stale = tmp_path / header / "f.kv"
    stale.write_bytes((tmp_path / header).glob("*.kv").__next__().read_bytes())
    store = _store(tmp_path, models=("m",))  # "gone" is no longer configured
    assert not (tmp_path / other.space).exists() and not (tmp_path / "junk").exists()
    new = store.space("m", {"template": "b", "kv_bits": 0})  # the template changed
    assert new.best(k + (1,), 100) is None
    store.flush()
    assert not (tmp_path / old.space).exists()
    assert store.counters().incompatible_removed >= 3 and store.counters().entries == 0


@pytest.mark.mlx
def test_the_loader_keys_a_space_by_model_files_adapter_template_and_kv_bits(tmp_path):
    from mlxd.actors.engine.loading import load
    from mlxd.actors.engine.runner.prefix_cache import PrefixCache
    from mlxd.actors.engine.scheduler.options import DiskTierOptions, LoadOptions

    model = tmp_path / "model"
    model.mkdir()
    (model / "weights.safetensors").write_bytes(b"x" * 10)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapters.safetensors").write_bytes(b"y")
    store = _store(tmp_path / "disk", models=("m",))

    def space(template: str = "", **fields) -> str:
        cache = PrefixCache(block_size=64, max_bytes=1 << 20)
        disk = DiskTierOptions(store=store, slug="m", chat_template=template)
        options = LoadOptions(path="", cache_dir=tmp_path, dequantize_on_cpu=False, max_batch=1)
        options = dataclasses.replace(options, disk_tier=disk, **fields)
        load._attach_disk(cache, options, model, lambda: [])
        return cache.disk.space

    base = space()
    assert space() == base
    others = [space("{{ messages }}"), space(kv_bits=4), space(kv_bits=8)]
    others.append(space(adapter_path=adapter))
    (model / "weights.safetensors").write_bytes(b"z" * 11)  # the weights changed
    others.append(space())
    assert len({base, *others}) == 6
    store.flush()


def test_format_version_change_cleans_files(tmp_path, monkeypatch):
    store = _store(tmp_path)
    view = store.space("m", {"k": 1})
    k = tuple(range(100))
    view.spill(k, False, _enc(k))
    store.flush()
    store.close()
    monkeypatch.setattr(disk_tier, "FORMAT_VERSION", disk_tier.FORMAT_VERSION + 1)
    store = _store(tmp_path)
    assert store.counters().incompatible_removed == 1 and store.counters().entries == 0
    assert not list(tmp_path.rglob("*.kv"))


def test_unwritable_dir_degrades_to_ram_with_one_log_line(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("disk_dir cannot be made under a file")
    with caplog.at_level(logging.WARNING, logger="mlxd.disk_cache"):
        store = _store(blocker / "cache")
        view = store.space("m", {"k": 1})
        for i in range(5):
            k = tuple(range(i, i + 80))
            view.spill(k, False, _enc(k))
        store.flush()
    c = store.counters()
    assert not c.writable and c.entries == 0 and c.spills_dropped == 5
    assert len([r for r in caplog.records if "writes off" in r.getMessage()]) == 1


def test_a_full_disk_degrades_to_ram_with_one_log_line(tmp_path, caplog, monkeypatch):
    store = _store(tmp_path)
    view = store.space("m", {"k": 1})

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_tier.os, "replace", full)
    with caplog.at_level(logging.WARNING, logger="mlxd.disk_cache"):
        for i in range(4):
            k = tuple(range(i, i + 80))
            view.spill(k, False, _enc(k))
        store.flush()
    assert not store.counters().writable and store.counters().entries == 0
    assert not list(tmp_path.rglob("*.tmp"))  # the temporary file went too
    assert len([r for r in caplog.records if "writes off" in r.getMessage()]) == 1


def test_a_second_store_on_the_same_dir_leaves_it_alone(tmp_path, caplog):
    """Two daemons given one ``disk_dir``: the second would delete the first one's
    files at start-up (another model's space) and overrun the shared budget; it keeps
    its cache in RAM instead, says so once, and touches nothing."""
    first = _store(tmp_path, models=("m",))
    view = first.space("m", {"k": 1})
    for i in range(3):
        k = tuple(range(i * 100, i * 100 + 80))
        view.spill(k, False, _enc(k))
    first.flush()
    files = sorted(tmp_path.rglob("*.kv"))
    assert len(files) == 3 and (tmp_path / disk_tier.LOCK).read_text().strip() == str(os.getpid())
    with caplog.at_level(logging.WARNING, logger="mlxd.disk_cache"):
        second = _store(tmp_path, models=("other",))  # would delete "m"'s space
        other = second.space("m", {"k": 2})  # would delete "m"'s sibling spaces
        k = tuple(range(1000, 1080))
        assert not other.spill(k, False, _enc(k))
        assert other.best(k, len(k)) is None
        second.clear().result()
        second.flush()
    c = second.counters()
    assert not c.enabled and not c.writable and c.owner_pid == os.getpid() and c.entries == 0
    assert sorted(tmp_path.rglob("*.kv")) == files
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and f"pid {os.getpid()}" in warned[0], warned
    assert len(_read_all(first, view.space)) == 3  # the owner goes on as before
    second.close()
    first.close()  # releases the directory: the next store owns it and indexes the files
    third = _store(tmp_path)
    assert third.owned and third.counters().entries == 3
    third.close()


def test_a_killed_owner_releases_the_dir(tmp_path):
    """The lock dies with its process (``kill -9`` included): the next start owns the
    directory and finds the files the killed daemon wrote."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path), "10000000", "0"],
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        assert proc.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + WAIT_S
        while not list(tmp_path.rglob("*.kv")):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        blocked = _store(tmp_path)
        assert not blocked.owned and blocked.counters().owner_pid == proc.pid
        blocked.close()
    finally:
        proc.kill()
        proc.wait()
    store = _store(tmp_path)
    assert store.owned and store.counters().enabled and store.counters().entries > 0
    store.close()


_WRITER = textwrap.dedent(
    """
    import hashlib, sys
    from mlxd.actors.engine.runner.disk_tier import DiskStore, Encoded
    root, budget = sys.argv[1], int(sys.argv[2])
    store = DiskStore(root, budget, ["m"])
    view = store.space("m", {"k": 1})
    store.scanned.result()
    print("ready", flush=True)
    i = int(sys.argv[3])
    while True:
        tokens = tuple(range(i, i + 100))
        seed = hashlib.sha256(repr(tokens).encode()).digest()
        size = 20000 + (i % 7) * 5000
        data = (seed * (size // 32 + 1))[:size]
        layers = [{"c": "fake", "state": {"a": "uint8", "s": [size], "o": 0, "n": size}}]
        view.spill(tokens, False, Encoded(layers, [data], size))
        store.flush()
        i += 1
    """
)


@pytest.mark.slow  # 20 processes killed
def test_kill_9_at_20_random_moments_loses_only_the_file_being_written(tmp_path):
    """A subprocess running the real store writer (fsync and all) is killed with SIGKILL
    at 20 random moments (a daemon per kill would take minutes); afterwards the files stay
    within the budget and a reopened store serves only intact, byte-identical entries."""
    budget = 400_000
    rng = random.Random(22)
    for round_ in range(20):
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(tmp_path), str(budget), str(round_ * 1000)],
            stdout=subprocess.PIPE,
            cwd=ROOT,
        )
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.0, 0.3))
        proc.kill()
        proc.wait()
        assert _disk_bytes(tmp_path) <= budget
    store = DiskStore(tmp_path, budget, ["m"])
    store.scanned.result()
    view = store.space("m", {"k": 1})
    served = _read_all(store, view.space)
    assert served and store.counters().bytes <= budget
    for tokens, payload in served.items():
        assert payload == _payload(tokens, len(payload))
        assert len(payload) == 20000 + (tokens[0] % 7) * 5000
    assert not list(tmp_path.rglob("*.tmp"))


# ---- blocks and write-behind, by hand (no mlx) -------------------------------------------

ROW = 192  # bytes of one token's row in a fake KV array (2 heads of 96 bytes)


def _row(i: int, token: int) -> bytes:
    """Token ``i``'s KV row: a function of its position and token only, as real KV is of
    its prefix, so snapshots sharing a prefix share these bytes."""
    return (hashlib.sha256(f"{i}:{token}".encode()).digest() * 3)[: ROW // 2]


def _kv_enc(tokens: tuple[int, ...], pad: int = 0) -> tuple[Encoded, bytes]:
    """A hybrid-like snapshot: append-only KV (``pad`` rows of spare capacity past the
    tokens, as KVCache allocates) and 40 bytes of state of its own; and the payload a
    read must give back (the KV cut at the tokens, then the state)."""
    rows = [_row(i, t) for i, t in enumerate(tokens)] + [b"\0" * (ROW // 2)] * pad
    heads = [b"".join(r for r in rows), b"".join(r[::-1] for r in rows)]  # [1, 2, T, ROW // 2]
    kv, state = b"".join(heads), _payload(tokens, 40)
    n_rows = len(tokens) + pad
    node = {"a": "uint8", "s": [1, 2, n_rows, ROW // 2], "o": 0, "n": len(kv), "b": 2}
    layers = [
        {"c": "kv", "state": {"t": [node, {"v": len(tokens)}]}},
        {"c": "ssm", "state": {"a": "uint8", "s": [40], "o": len(kv), "n": 40}},
    ]
    cut = b"".join(h[: len(tokens) * ROW // 2] for h in heads)
    return Encoded(layers, [kv, state], len(kv) + 40), cut + state


def _blocks(root: Path) -> dict[str, int]:
    """Block files by name, with their inode (a rewritten file gets a new one)."""
    return {p.name: p.stat().st_ino for p in root.rglob(f"*{disk_tier.BLOCK_SUFFIX}")}


def _grow(store: DiskStore, view, turns: int, trimmable: bool, step: int = 23):
    """A conversation growing ``step`` tokens a turn, each turn's snapshot written."""
    tokens: tuple[int, ...] = ()
    seen: dict[str, int] = {}
    for turn in range(turns):
        tokens += tuple(range(1000 + turn * step, 1000 + (turn + 1) * step))
        enc, _ = _kv_enc(tokens, pad=7)
        view.spill(tokens, trimmable, enc)
        store.flush()
        for name, inode in _blocks(store.root).items():
            assert seen.setdefault(name, inode) == inode, f"block {name} written twice"
    return tokens, seen


@pytest.mark.parametrize("trimmable", [True, False])
def test_a_growing_conversation_writes_each_block_once(tmp_path, trimmable):
    """Attention-only (trimmable: each turn's file replaces the last) and hybrid (each
    turn's file stays): every block file is written once, and the bytes written are the
    new tokens plus at most a partial block a turn, where whole snapshots rewrite it all."""
    block, turns = 16, 10
    store = DiskStore(tmp_path / "b", 1 << 30, ["m"], block_tokens=block, fsync=False)
    view = store.space("m", {"k": 1})
    tokens, seen = _grow(store, view, turns, trimmable)
    c = store.counters()
    assert c.block_writes == len(seen) == c.blocks == len(tokens) // block
    assert c.writes == turns and c.entries == (1 if trimmable else turns)
    assert _disk_bytes(tmp_path / "b") == c.bytes
    headers = c.writes * 2048 + c.block_writes * 64
    assert c.bytes_written <= (len(tokens) + turns * block) * ROW + turns * 40 + headers
    assert _read_all(store, view.space)[tokens] == _kv_enc(tokens)[1]
    whole = DiskStore(tmp_path / "w", 1 << 30, ["m"], block_tokens=0, fsync=False)
    _grow(whole, whole.space("m", {"k": 1}), turns, trimmable)
    assert whole.counters().blocks == 0
    assert c.bytes_written * 3 < whole.counters().bytes_written  # measured: about 1/4


def test_shared_blocks_count_once_and_outlive_a_snapshot(tmp_path):
    store = _store(tmp_path)
    store.block_tokens = 16
    view = store.space("m", {"k": 1})
    prefix = tuple(range(100, 148))  # three blocks both snapshots share
    a, b = prefix + tuple(range(22)), prefix + tuple(range(500, 522))
    for k in (a, b):
        view.spill(k, False, _kv_enc(k, pad=3)[0])
    store.flush()
    c = store.counters()
    assert c.blocks == 5 and c.entries == 2  # 3 shared + one of each's own
    assert _disk_bytes(tmp_path) == c.bytes
    assert _read_all(store, view.space)[b] == _kv_enc(b)[1]  # b is now more recent than a
    # room for one more file only if a (the least recently used) goes
    other = tuple(range(9000, 9030))
    store.max_bytes = c.bytes + 1500
    view.spill(other, False, _enc(other, 1400))
    store.flush()
    c = store.counters()
    assert c.evictions == 1 and c.entries == 2 and c.blocks == 4  # a's own block went
    assert view.best(a, len(a)) is None
    assert _read_all(store, view.space)[b] == _kv_enc(b)[1]
    assert _disk_bytes(tmp_path) == c.bytes <= store.max_bytes


def test_a_corrupt_block_is_a_miss_for_every_snapshot_naming_it(tmp_path):
    store = _store(tmp_path)
    store.block_tokens = 16
    view = store.space("m", {"k": 1})
    prefix = tuple(range(100, 148))
    a, b, alone = prefix + (1, 2, 3), prefix + (4, 5, 6), tuple(range(700, 740))
    for k in (a, b, alone):
        view.spill(k, False, _kv_enc(k)[0])
    store.flush()
    shared = next(p for p in (tmp_path / view.space).glob("*.blk") if _names(store, p) == 2)
    data = bytearray(shared.read_bytes())
    data[-3] ^= 0xFF  # a flipped KV byte: only a read sees it
    shared.write_bytes(bytes(data))
    assert _read_all(store, view.space) == {alone: _kv_enc(alone)[1]}
    c = store.counters()
    assert c.corrupt_removed == 3 and c.entries == 1 and c.blocks == 2  # alone's two
    assert view.best(b + (9,), len(b)) is None and not shared.exists()
    assert _disk_bytes(tmp_path) == c.bytes


def _names(store: DiskStore, block: Path) -> int:
    with store._lock:
        return next(s.blocks[block.stem].refs for s in store._spaces.values())


def test_the_index_rebuilt_at_start_up_counts_block_names(tmp_path):
    store = _store(tmp_path)
    store.block_tokens = 16
    view = store.space("m", {"k": 1})
    prefix = tuple(range(100, 148))
    a, b, c_ = prefix + tuple(range(20)), prefix + tuple(range(50, 70)), tuple(range(300, 340))
    for k in (a, b, c_):
        view.spill(k, False, _kv_enc(k)[0])
    store.flush()
    before = store.counters()
    store.close()
    space = tmp_path / view.space
    with_blocks = {p: json_header(p) for p in space.glob("*.kv")}
    c_file = next(p for p, h in with_blocks.items() if tuple(h["tokens"]) == c_)
    c_file.unlink()  # a crash after c's blocks, before its file: c's blocks are orphans
    a_file = next(p for p, h in with_blocks.items() if tuple(h["tokens"]) == a)
    own = [k for k in json_header(a_file)["blocks"] if k not in json_header_of(b, with_blocks)]
    (space / f"{own[0]}.blk").unlink()  # a lost block: a must not be served
    store = _store(tmp_path)
    view = store.space("m", {"k": 1})
    c = store.counters()
    assert c.entries == 1 and c.blocks == 4  # b: three shared blocks and its own
    assert c.torn_removed == 2 and c.corrupt_removed == 1  # c's blocks; a
    assert c.bytes == _disk_bytes(tmp_path) < before.bytes
    assert _read_all(store, view.space) == {b: _kv_enc(b)[1]}
    with store._lock:  # the names were counted again: b's going frees every block
        entry = store._spaces[view.space].entries[b]
    store.discard(entry)
    store.flush()
    assert store.counters().blocks == 0 and not list(space.glob("*.blk"))


def json_header(path: Path) -> dict:
    header, _ = disk_tier._read_header(path)
    return header


def json_header_of(tokens: tuple[int, ...], headers: dict) -> list[str]:
    return next(h["blocks"] for h in headers.values() if tuple(h["tokens"]) == tokens)


def test_write_behind_writes_within_the_delay_unflushed(tmp_path):
    """Nothing flushes: the clock hands the snapshot to the I/O thread when it is due."""
    store = DiskStore(tmp_path, 1 << 20, ["m"], write_behind_s=0.2, fsync=False)
    view = store.space("m", {"k": 1})
    k = tuple(range(80))
    assert view.spill(k, True, _enc(k), behind=True)
    deadline = time.monotonic() + WAIT_S
    while store.counters().writes < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert store.counters().pending_writes == 0 and list(tmp_path.rglob("*.kv"))
    store.close()


def test_write_behind_coalesces_a_turn_and_stays_bounded(tmp_path):
    store = DiskStore(
        tmp_path, 1 << 20, ["m"], write_behind_s=600, max_pending_bytes=12_000, fsync=False
    )
    view = store.space("m", {"k": 1})
    prompt = tuple(range(80))
    answer = prompt + (1, 2, 3)
    assert view.spill(prompt, True, _enc(prompt), behind=True)
    assert view.spill(answer, True, _enc(answer), behind=True)  # replaces the prompt's
    assert view.spill(prompt, True, _enc(prompt))  # RAM evicts it: the held one serves it
    hybrid = tuple(range(500, 580))
    assert view.spill(hybrid, False, _enc(hybrid), behind=True)  # not trimmable: its own
    c = store.counters()
    assert c.coalesced == 2 and c.pending_writes == 2 and c.writes == 0
    other = tuple(range(900, 980))
    assert not view.spill(other, False, _enc(other), behind=True)  # past the queue's bound
    assert store.counters().spills_dropped == 1
    store.flush()
    c = store.counters()
    assert c.writes == 2 and c.pending_writes == 0
    assert set(_read_all(store, view.space)) == {answer, hybrid}
    gone = tuple(range(2000, 2080))
    view.spill(gone, True, _enc(gone), behind=True)
    view.clear().result()  # DELETE /v1/cache: what is held goes too, never written after
    store.flush()
    assert store.counters().entries == 0 and not list(tmp_path.rglob("*.kv"))
    store.close()


# ---- the codec: every cache kind, bit for bit ------------------------------------------


@pytest.mark.mlx
def test_codec_round_trips_every_cache_kind_bit_for_bit():
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import (
        ArraysCache,
        CacheList,
        KVCache,
        QuantizedKVCache,
        RotatingKVCache,
    )
    from mlxd.actors.engine.runner import disk_codec

    kv = KVCache()
    kv.update_and_fetch(mx.random.normal((1, 2, 10, 4)), mx.random.normal((1, 2, 10, 4)))
    rot = RotatingKVCache(max_size=8)
    x = mx.random.normal((1, 2, 12, 4)).astype(mx.bfloat16)
    rot.update_and_fetch(x, x)
    arrays = ArraysCache(2)
    arrays[0] = mx.random.normal((1, 3, 4))
    both = CacheList(ArraysCache(1), KVCache())
    both.caches[0][0] = mx.ones((1, 2))
    both.caches[1].update_and_fetch(mx.ones((1, 1, 3, 2)), mx.ones((1, 1, 3, 2)))
    quant = QuantizedKVCache(group_size=32, bits=4)
    quant.update_and_fetch(mx.random.normal((1, 2, 5, 64)), mx.random.normal((1, 2, 5, 64)))
    from mlxd.actors.engine.runner.kv_quant import QuantizedRowCache

    rows = QuantizedRowCache(group_size=32, bits=8)  # mlxd's own (engine.kv_bits)
    rows.update_and_fetch(mx.random.normal((1, 2, 7, 64)), mx.random.normal((1, 2, 7, 64)))
    snapshot = [kv, rot, arrays, both, quant, rows]
    mx.eval([c.state for c in snapshot])
    enc = disk_codec.encode(snapshot)
    back = disk_codec.decode(enc.layers, memoryview(b"".join(bytes(b) for b in enc.buffers)))
    for a, b in zip(snapshot, back, strict=True):
        assert type(a) is type(b)
        for (ka, va), (kb, vb) in zip(tree_flatten(a.state), tree_flatten(b.state), strict=True):
            assert ka == kb
            if isinstance(va, mx.array):
                assert va.dtype == vb.dtype and mx.array_equal(va, vb).item()
            else:
                assert va == vb
    assert back[1].offset == rot.offset and back[1]._idx == rot._idx
    assert (back[5].offset, back[5].bits, back[5].group_size) == (7, 8, 32)


# ---- one daemon, three models, restarts --------------------------------------------------

SYSTEM = (
    "You are a careful assistant for a software team. You answer questions about code, "
    "explain build failures, review patches and write short tests. Keep answers brief, "
    "name files and functions exactly, and say when you are not sure. The project is a "
    "serving daemon with an HTTP front end, a tokenizer stage, one generation thread and "
    "a streamer; its prefix cache keeps snapshots of prompts in memory and on disk. "
)  # past one 64-token block
MODELS = ("smol", "hybrid", "swa")


class Daemon:
    """``mlxd serve`` with three [[models]] (max_loaded 1) and a disk tier, restartable."""

    def __init__(
        self, tmp: Path, paths: dict[str, Path], max_loaded: int = 1, disk_settings: str = ""
    ):
        self.tmp, self.port = tmp, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = tmp / "mlxd.toml"
        entries = "".join(f'[[models]]\nid = "{m}"\npath = "{p}"\n' for m, p in paths.items())
        self.config.write_text(
            f'[model]\ncache_dir = "{tmp / "cache"}"\n'
            f"[model_pool]\nmax_loaded = {max_loaded}\n"
            f'[prefix_cache]\ndisk_dir = "{tmp / "disk"}"\n{disk_settings}' + entries
        )
        self.conversations = {m: [{"role": "system", "content": SYSTEM}] for m in paths}
        self.proc: subprocess.Popen | None = None
        self.turn = 0

    def start(self) -> None:
        self.log = self.tmp / f"mlxd-{time.monotonic_ns()}.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlxd.daemon.cli", "serve", "--port", str(self.port)]
                + ["--config", str(self.config)],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )
        wait_healthy(self.url, lambda: self.proc.poll() is None, WAIT_S, self.log.read_text)

    def stop(self, sig: int) -> None:
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=WAIT_S)
        assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL), self.log.read_text()

    def chat(self, model: str, messages: list[dict]) -> tuple[str, int]:
        body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=WAIT_S)
        assert r.status_code == 200, r.text
        data = r.json()
        cached = data["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        return data["choices"][0]["message"]["content"], cached

    def cache(self, model: str) -> dict:
        r = httpx.get(f"{self.url}/v1/cache", params={"model": model}, timeout=WAIT_S)
        return r.json()

    def ask(self, model: str) -> list[dict]:
        self.turn += 1
        messages = [*self.conversations[model], {"role": "user", "content": f"Step {self.turn}?"}]
        return messages

    def turn_cold(self, model: str) -> None:
        messages = self.ask(model)
        text, _ = self.chat(model, messages)
        self.conversations[model] = [*messages, {"role": "assistant", "content": text}]

    def turn_warm(self, model: str) -> None:
        """The next turn is a disk hit, and the same answer as a cold run (both tiers cleared)."""
        messages = self.ask(model)
        text, cached = self.chat(model, messages)
        stats = self.cache(model)  # the model is loaded: its counters are published
        assert cached > 0 and stats["disk_hits"] >= 1, (model, cached, stats)
        r = httpx.delete(f"{self.url}/v1/cache", params={"model": model}, timeout=WAIT_S)
        assert r.status_code == 200
        cold, cold_cached = self.chat(model, messages)
        assert cold_cached == 0 and cold == text, (model, cold, text)
        self.conversations[model] = [*messages, {"role": "assistant", "content": text}]

    def wait_written(self, model: str, writes: int = 1) -> dict:
        deadline = time.monotonic() + WAIT_S
        while (disk := self.cache(model)["disk"])["pending_writes"] or disk["writes"] < writes:
            assert time.monotonic() < deadline, disk
            time.sleep(0.1)
        return disk


@pytest.mark.mlx
def test_restarts_and_unloads_keep_contexts_warm(tmp_path, tiny_models, smollm_tokenizer):
    """SmolLM2, a GatedDeltaNet hybrid and a sliding-window model in one pool of one:
    an unload spills (the reload is a disk hit), SIGTERM spills what RAM holds, and files
    written before a ``kill -9`` serve the next start; every warm answer equals a cold one.
    (SmolLM2 loads once per start: the switches that test unloads use the tiny models.)"""
    paths = {"smol": smollm_tokenizer, "hybrid": tiny_models("qwen3_5")}
    paths["swa"] = tiny_models("baichuan_m1")
    d = Daemon(tmp_path, paths)
    d.start()
    try:
        for m in ("hybrid", "smol", "swa"):
            d.turn_cold(m)  # each switch unloads the other model: its snapshots spill
        d.turn_warm("hybrid")  # unloaded, reloaded: warm from disk
        d.stop(signal.SIGTERM)  # hybrid's newest snapshots are only in RAM: the drain spills
        d.start()
        for m in ("hybrid", "swa", "smol"):
            d.turn_warm(m)
        d.chat("hybrid", d.ask("hybrid"))  # unloads smol: its last snapshots spill
        d.wait_written("hybrid")
        d.stop(signal.SIGKILL)
        d.start()
        for m in MODELS:
            d.turn_warm(m)
        text = d.log.read_text()
        assert "Traceback" not in text
        status = httpx.get(f"{d.url}/v1/status", timeout=WAIT_S).json()
        assert status["cache"]["disk"]["bytes"] > 0
        metrics = httpx.get(f"{d.url}/metrics", timeout=WAIT_S).text
        assert 'mlxd_prefix_cache_hits_total{model="swa",tier="disk"}' in metrics
        written = [ln for ln in metrics.splitlines() if ln.startswith("mlxd_prefix_cache_disk_")]
        by_name = {ln.split()[0]: float(ln.split()[-1]) for ln in written}
        assert by_name["mlxd_prefix_cache_disk_bytes_written_total"] > 0, written
        assert "mlxd_prefix_cache_disk_blocks" in by_name  # turns here are under one block
        assert "mlxd_prefix_cache_disk_coalesced_total" in by_name
        bad = httpx.delete(f"{d.url}/v1/cache", params={"tier": "ssd"}, timeout=WAIT_S)
        assert bad.status_code == 400 and "tier" in bad.text
        r = httpx.delete(f"{d.url}/v1/cache", params={"tier": "disk"}, timeout=WAIT_S)
        assert r.status_code == 200
        deadline = time.monotonic() + WAIT_S
        while (stats := d.cache("swa"))["disk"]["entries"]:  # the I/O thread clears it soon
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert stats["entries"] > 0  # RAM kept its snapshots
        assert not list((tmp_path / "disk").rglob("*.kv"))
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


@pytest.mark.mlx
def test_a_kill_9_keeps_the_conversation(tmp_path, tiny_models, smollm_tokenizer):
    """Write-behind: nothing is evicted, unloaded or shut down, yet a conversation's
    snapshots reach the disk within ``disk_write_behind_s``; ``kill -9`` after that, and
    the next start's next turn is a disk hit with a cold run's greedy answer, on SmolLM2
    and the GatedDeltaNet hybrid (attention KV in 32-token blocks, SSM state whole)."""
    paths = {"smol": smollm_tokenizer, "hybrid": tiny_models("qwen3_5")}
    settings = "disk_write_behind_s = 0.5\ndisk_block_tokens = 32\n"
    d = Daemon(tmp_path, paths, max_loaded=2, disk_settings=settings)
    d.start()
    try:
        for m in (*paths, *paths):
            d.turn_cold(m)
        disk = d.wait_written("smol", writes=4)  # no flush asks for it: the clock does
        assert disk["blocks"] > 0 and disk["block_writes"] == disk["blocks"], disk
        d.stop(signal.SIGKILL)
        d.start()
        for m in paths:
            d.turn_warm(m)
        assert "Traceback" not in d.log.read_text()
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


@pytest.mark.mlx
@pytest.mark.parametrize(("model", "kv_bits"), [("llama", 0), ("qwen3_5", 0), ("smol", 8)])
def test_a_real_conversation_writes_each_block_once_and_reads_back_exact(
    tmp_path, tiny_models, smollm_tokenizer, model, kv_bits
):
    """Real caches (KVCache; a hybrid's KVCache and ArraysCache; quantized KV rows): four
    turns of a growing conversation write each 16-token block once; with RAM emptied the
    next turn is assembled from blocks and answers as a cold run does."""
    from mlxd.actors.engine.loading.load import load_runner
    from mlxd.actors.engine.scheduler.core import EngineCore
    from mlxd.actors.engine.scheduler.options import DiskTierOptions, PrefixCacheOptions

    from tests.engine_driver import request

    store = DiskStore(
        tmp_path / "disk", 1 << 30, ["m"], write_behind_s=600, block_tokens=16, fsync=False
    )
    path = smollm_tokenizer if model == "smol" else tiny_models(model)
    runner, _ = load_runner(
        str(path),
        tmp_path,
        dequantize_on_cpu=True,
        max_batch=2,
        kv_bits=kv_bits,
        prefix_cache=PrefixCacheOptions(block_size=16, max_bytes=256 << 20),
        disk_tier=DiskTierOptions(store=store, slug="m"),
    )
    core = EngineCore(runner, max_batch=2, prefill_chunk_tokens=64)

    def run(r):
        out, started = [], {}
        core.submit(r)
        while not core.idle:
            step = core.step()
            started |= {s.request_id: s.cached_tokens for s in step.started}
            out += [x for t in step.tokens for x in t.tokens]
        return out, started[r.request_id]

    conversation = [(7 * i) % 4000 + 10 for i in range(40)]
    seen: dict[str, int] = {}
    for turn in range(4):
        out, _ = run(request(f"t{turn}", conversation, 6))
        store.flush()  # what write-behind does within disk_write_behind_s
        for name, inode in _blocks(tmp_path / "disk").items():
            assert seen.setdefault(name, inode) == inode, f"block {name} written twice"
        conversation += out + [(11 * i + turn) % 4000 + 10 for i in range(20)]
    c = store.counters()
    assert c.block_writes == len(seen) == c.blocks >= 6, c
    runner.clear_cache(tier="ram")  # as after a restart
    warm, cached = run(request("warm", conversation, 6))
    assert cached > 16 and runner.prefix_cache.stats.disk_hits == 1
    runner.clear_cache()
    cold, cached = run(request("cold", conversation, 6))
    assert cached == 0 and cold == warm
    store.close()


# ---- the engine: a read never stalls decoding -----------------------------------------


@pytest.mark.mlx
def test_a_request_waits_for_its_read_while_others_decode_and_a_bad_file_is_a_miss(
    tmp_path, tiny_models
):
    import threading
    from collections import defaultdict

    from mlxd.actors.engine.loading.load import load_runner
    from mlxd.actors.engine.scheduler.core import EngineCore
    from mlxd.actors.engine.scheduler.options import DiskTierOptions, PrefixCacheOptions

    from tests.engine_driver import request

    store = _store(tmp_path / "disk", models=("m",))
    store.block_tokens = 16  # the 120-token prompt's KV is in blocks
    runner, _ = load_runner(
        str(tiny_models("llama")),
        tmp_path,
        dequantize_on_cpu=True,
        max_batch=4,
        prefix_cache=PrefixCacheOptions(block_size=16, max_bytes=64 << 20),
        disk_tier=DiskTierOptions(store=store, slug="m"),
    )
    core = EngineCore(runner, max_batch=4, prefill_chunk_tokens=64)

    def run(*requests, until=None):
        out: dict[str, list[int]] = defaultdict(list)
        started = {}
        for r in requests:
            core.submit(r)
        while not core.idle and (until is None or not until(out)):
            step = core.step()
            started |= {s.request_id: s.cached_tokens for s in step.started}
            for t in step.tokens:
                out[t.request_id] += t.tokens
        return out, started

    prompt = [(7 * i) % 5000 + 10 for i in range(120)]
    longer = prompt + [11, 12, 13]
    cold, _ = run(request("cold", longer, 8))
    runner.clear_cache()
    run(request("first", prompt, 4))
    runner.spill_cache(wait=True)  # RAM empty, the snapshot on disk
    assert runner.prefix_cache.stats.entries == 0 and store.counters().entries == 1
    gate = threading.Event()
    store._io.submit(gate.wait)  # the I/O thread is busy: the read below waits
    timer = threading.Timer(WAIT_S, gate.set)  # a read on the engine thread: fail, not hang
    timer.daemon = True
    timer.start()
    out, _ = run(request("other", [5, 6, 7, 8] * 10, 40), until=lambda o: len(o["other"]) >= 2)
    core.submit(request("warm", longer, 8))
    before = len(out["other"])
    for _ in range(5):
        step = core.step()
        out["other"] += [x for t in step.tokens for x in t.tokens]
        assert not step.started  # the warm request waits, not prefilling
    assert len(out["other"]) == before + 5  # decoding went on, a token per step
    gate.set()
    timer.cancel()
    rest, started = run()
    assert started["warm"] > 0 and runner.prefix_cache.stats.disk_hits == 1
    assert rest["warm"] == cold["cold"]  # the same greedy answer as a cold run
    runner.spill_cache(wait=True)
    snapshots = list((tmp_path / "disk").rglob("*.kv"))  # one block of each, not the tail
    names = {p.parent / f"{json_header(p)['blocks'][2]}{disk_tier.BLOCK_SUFFIX}" for p in snapshots}
    for block in names:  # each once: a shared block flipped twice would be whole again
        data = bytearray(block.read_bytes())
        data[-5] ^= 0xFF
        block.write_bytes(bytes(data))
    again, started = run(request("again", longer, 8))
    assert started["again"] == 0 and again["again"] == cold["cold"]
    assert store.counters().corrupt_removed >= 1
    store.close()
