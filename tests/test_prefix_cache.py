"""The prefix cache's sync core, with opaque snapshots."""

from mlxd.actors.engine.runner.prefix_cache import PrefixCache, block_hashes


def cache(max_bytes=10_000, block=4):
    return PrefixCache(block_size=block, max_bytes=max_bytes)


def test_block_hashes_chain_and_ignore_partial_tail():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)
    assert len(a) == 2
    assert a[0] == b[0]
    assert a[1] != b[1]


def test_trimmable_entry_serves_longest_common_prefix():
    c = cache()
    c.insert(list(range(20)), "snap", 100, trimmable=True)
    hit = c.lookup(list(range(10)) + [99, 98], limit=11)
    assert hit.entry.snapshot == "snap"
    assert hit.length == 10


def test_exact_hit_leaves_the_last_token_to_recompute():
    c = cache()
    prompt = list(range(12))
    c.insert(prompt, "snap", 100, trimmable=True)
    assert c.lookup(prompt, limit=len(prompt) - 1).length == 11


def test_non_trimmable_entry_only_at_its_exact_length():
    c = cache()
    c.insert(list(range(8)), "ssm@8", 100, trimmable=False)
    assert c.lookup(list(range(12)), limit=11).length == 8  # entry is a prefix: usable
    assert c.lookup(list(range(6)) + [50, 51, 52], limit=8) is None  # partial: a miss
    assert c.lookup(list(range(8)), limit=7) is None  # would need trimming: a miss
    assert c.stats.hits == 1
    assert c.stats.misses == 2


def test_best_of_several_non_trimmable_checkpoints():
    c = cache()
    c.insert(list(range(4)), "sys", 10, trimmable=False)
    c.insert(list(range(9)), "turn1", 10, trimmable=False)
    assert c.lookup(list(range(9)) + [7, 7], limit=10).entry.snapshot == "turn1"
    assert c.lookup(list(range(6)) + [7, 7], limit=7).entry.snapshot == "sys"


def test_lru_eviction_keeps_bytes_under_budget():
    c = cache(max_bytes=250)
    for i in range(5):
        c.insert([i] * 8, f"s{i}", 100, trimmable=False)
        assert c.stats.bytes <= 250
    assert c.stats.entries == 2
    assert c.stats.evictions == 3
    assert c.lookup([4] * 8 + [1], limit=8).entry.snapshot == "s4"
    assert c.lookup([0] * 8 + [1], limit=8) is None


def test_lookup_refreshes_lru_order():
    c = cache(max_bytes=200)
    c.insert([1] * 8, "a", 100, trimmable=False)
    c.insert([2] * 8, "b", 100, trimmable=False)
    c.lookup([1] * 9, limit=8)  # "a" is now the most recently used
    c.insert([3] * 8, "c", 100, trimmable=False)
    assert [1] * 8 in c
    assert [2] * 8 not in c


def test_longer_trimmable_entry_replaces_its_prefixes():
    c = cache()
    c.insert(list(range(8)), "short", 100, trimmable=True)
    c.insert(list(range(16)), "long", 200, trimmable=True)
    assert list(range(8)) not in c
    assert c.stats.bytes == 200


def test_oversized_snapshot_is_not_stored_and_clear_empties():
    c = cache(max_bytes=50)
    c.insert([1] * 8, "big", 100, trimmable=True)
    assert c.stats.entries == 0
    c = cache()
    c.insert([1] * 8, "x", 10, trimmable=True)
    c.clear()
    assert c.stats.bytes == 0
    assert c.lookup([1] * 9, limit=8) is None


def test_evict_frees_least_recently_used_first_and_peek_counts_nothing():
    c = cache()
    for i in range(3):
        c.insert([i] * 8, f"s{i}", 100, trimmable=False)
    assert c.peek([1] * 8 + [5], limit=8) == 8
    assert (c.stats.hits, c.stats.misses) == (0, 0)
    c.lookup([0] * 8 + [5], limit=8)  # s0 is now the most recently used
    assert c.evict(150) == 200  # s1, then s2
    assert c.stats.bytes == 100 and c.peek([0] * 8 + [5], limit=8) == 8
    assert c.evict(10_000) == 100 and c.stats.entries == 0


# ---- cache keys (prompt_cache_key): a key's newest snapshot is evicted last -------------


def test_a_keys_newest_snapshot_outlives_a_burst_of_keyless_ones():
    keyed, plain = cache(max_bytes=300), cache(max_bytes=300)
    for c in (keyed, plain):
        c.insert([9] * 8, "session", 100, trimmable=False)
    keyed.claim([9] * 8, "conversation-1")
    for c in (keyed, plain):
        for i in range(4):  # other traffic, each newer than the session's snapshot
            c.insert([i] * 8, f"s{i}", 100, trimmable=False)
    assert [9] * 8 not in plain  # plain LRU: the oldest went first
    assert [9] * 8 in keyed and keyed.stats.bytes <= 300
    assert [3] * 8 in keyed and [2] * 8 in keyed and [0] * 8 not in keyed
    assert keyed.lookup([9] * 8 + [1], limit=8, key="conversation-1").entry.snapshot == "session"


def test_only_the_newest_snapshot_of_a_key_is_protected():
    c = cache(max_bytes=300)
    c.insert([1] * 8, "turn-1", 100, trimmable=False)
    c.claim([1] * 8, "k")
    c.insert([2] * 8, "turn-2", 100, trimmable=False)
    c.claim([2] * 8, "k")  # k's newest now: turn-1 is an ordinary LRU entry again
    c.insert([3] * 8, "other", 100, trimmable=False)
    c.insert([4] * 8, "other-2", 100, trimmable=False)
    assert [1] * 8 not in c and [2] * 8 in c and [3] * 8 in c


def test_when_only_protected_snapshots_are_left_lru_applies_among_them():
    c = cache(max_bytes=200)
    c.insert([1] * 8, "a", 100, trimmable=False)
    c.claim([1] * 8, "ka")
    c.insert([2] * 8, "b", 100, trimmable=False)
    c.claim([2] * 8, "kb")
    c.insert([3] * 8, "new", 100, trimmable=False)  # never its own insert's victim
    assert [1] * 8 not in c and [2] * 8 in c and [3] * 8 in c
    assert c.evict(100) == 100 and [3] * 8 not in c  # unprotected first
    assert c.evict(100) == 100 and c.stats.entries == 0


def test_a_hit_claims_the_snapshot_and_memory_pressure_evicts_keyed_ones_last():
    c = cache()
    c.insert([1] * 8, "shared", 100, trimmable=False)
    c.insert([2] * 8, "x", 100, trimmable=False)
    c.insert([3] * 8, "y", 100, trimmable=False)
    assert c.lookup([1] * 8 + [5], limit=8, key="k").length == 8
    c.lookup([2] * 8 + [5], limit=8)  # keyless: only moves it in the LRU order
    c.lookup([3] * 8 + [5], limit=8)
    assert c.evict(200) == 200
    assert [1] * 8 in c and c.stats.entries == 1


def test_protection_is_bounded_to_the_most_recently_used_keys():
    c = PrefixCache(block_size=4, max_bytes=300, affinity_keys=2)
    for i in range(3):
        c.insert([i] * 8, f"s{i}", 100, trimmable=False)
        c.claim([i] * 8, f"key-{i}")  # key-0 drops out of the two most recent keys
    c.insert([7] * 8, "new", 100, trimmable=False)
    assert [0] * 8 not in c and [1] * 8 in c and [2] * 8 in c


def test_a_longer_trimmable_snapshot_inherits_the_keys_of_the_prefix_it_replaces():
    c = cache(max_bytes=200)
    c.insert(list(range(8)), "short", 100, trimmable=True)
    c.claim(list(range(8)), "k")
    c.insert(list(range(12)), "long", 100, trimmable=True)  # drops "short", serves it
    c.insert([50] * 8, "a", 100, trimmable=True)
    c.insert([60] * 8, "b", 100, trimmable=True)
    assert list(range(12)) in c and [50] * 8 not in c


def test_keys_change_nothing_with_affinity_off():
    c = PrefixCache(block_size=4, max_bytes=200, affinity_keys=0)
    c.insert([1] * 8, "a", 100, trimmable=False)
    c.claim([1] * 8, "k")
    c.insert([2] * 8, "b", 100, trimmable=False)
    c.insert([3] * 8, "c", 100, trimmable=False)
    assert [1] * 8 not in c
