from octo.engine import KVHandle
from octo.scheduler.prefix_cache import PrefixCache


def make(budget=10_000, min_match=2):
    freed = []
    return PrefixCache(budget, freed.append, min_match=min_match), freed


def h(tokens, nbytes=100):
    return KVHandle(tuple(tokens), nbytes, data=tuple(tokens))


def test_longest_common_prefix_hits_a_longer_entry():
    cache, _ = make()
    cache.insert(h([1, 2, 3, 4, 5, 6]))  # system(1,2,3) + user1(4) + reply(5,6)
    handle, n = cache.lookup([1, 2, 3, 9, 9], max_len=4)  # system + a different user turn
    assert handle.tokens == (1, 2, 3, 4, 5, 6) and n == 3
    assert cache.stats()["hits"] == 1 and cache.stats()["tokens_reused"] == 3


def test_miss_below_min_match_and_max_len_respected():
    cache, _ = make(min_match=3)
    cache.insert(h([1, 2, 3, 4]))
    assert cache.lookup([1, 2, 7], 3) == (None, 0)
    handle, n = cache.lookup([1, 2, 3, 4], max_len=3)  # never the whole prompt: one token must be fed
    assert n == 3
    assert cache.stats()["misses"] == 1


def test_prefix_entries_are_superseded_and_redundant_ones_freed():
    cache, freed = make()
    short, long_ = h([1, 2, 3]), h([1, 2, 3, 4, 5])
    cache.insert(short)
    cache.insert(long_)
    assert freed == [short] and cache.stats()["entries"] == 1
    again = h([1, 2])
    cache.insert(again)  # covered by the longer entry
    assert freed[-1] is again and cache.stats()["entries"] == 1


def test_lru_eviction_by_bytes():
    cache, freed = make(budget=250)
    a, b, c = h([1, 1, 1], 100), h([2, 2, 2], 100), h([3, 3, 3], 100)
    cache.insert(a)
    cache.insert(b)
    cache.lookup([1, 1, 1, 0], 4)  # touch a
    cache.insert(c)
    assert freed == [b]
    assert cache.stats()["bytes"] == 200 and cache.stats()["evictions"] == 1
    assert cache.lookup([2, 2, 2, 0], 4) == (None, 0)  # pruned from the trie


def test_oversized_handle_is_freed():
    cache, freed = make(budget=50)
    big = h([1, 2, 3], 100)
    cache.insert(big)
    assert freed == [big] and cache.stats()["entries"] == 0


def test_clear_frees_everything():
    cache, freed = make()
    cache.insert(h([1, 2, 3]))
    cache.insert(h([4, 5, 6]))
    cache.clear()
    assert len(freed) == 2 and cache.stats()["bytes"] == 0


def test_failed_restore_counts_as_a_miss():
    cache, _ = make()
    cache.insert(h([1, 2, 3, 4]))
    handle, n = cache.lookup([1, 2, 3, 9], 4)
    cache.restore_failed(n)
    s = cache.stats()
    assert (s["hits"], s["misses"], s["tokens_reused"]) == (0, 1, 0)


def test_a_repeated_peek_is_not_walked_again_and_sees_every_change():
    """Admission peeks at a waiting prompt every step: the same token list is answered from the last walk until an
    insert or an eviction changes the trie, and then walked again."""
    cache, _ = make()
    prompt = [1, 2, 3, 4, 5, 6, 7]
    walks = []
    walk = cache._walk
    cache._walk = lambda *a: walks.append(a) or walk(*a)
    assert cache.peek(prompt, 6) == (None, 0)
    short = h([1, 2, 3, 9])
    cache.insert(short)  # a change: the next peek walks
    assert cache.peek(prompt, 6) == (short, 3) and cache.peek(prompt, 6) == (short, 3) and len(walks) == 2
    assert cache.peek(list(prompt), 6) == (short, 3) and len(walks) == 3  # another list (its contents may differ)
    assert cache.peek(prompt, 5) == (short, 3) and len(walks) == 4  # another bound
    longer = h([1, 2, 3, 4, 5])
    cache.insert(longer)
    assert cache.peek(prompt, 5) == (longer, 5)
    prompt.append(8)  # the list grew: walked again
    assert cache.peek(prompt, 7) == (longer, 5) and len(walks) == 6
    cache.lookup(prompt, 7)  # a lookup may use the walk, and counts it
    assert len(walks) == 6 and cache.stats()["hits"] == 1
    assert cache.evict_pool() is False  # no pool cells held: nothing evicted
    cache.clear()
    assert cache.peek(prompt, 7) == (None, 0) and len(walks) == 7
