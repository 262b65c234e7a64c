"""The prefix cache's sync core, with opaque snapshots."""

from mlxd.actors.engine.prefix_cache import PrefixCache, block_hashes


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
