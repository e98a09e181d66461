"""PagePool: null page, refcounts, exact prefix-cache chains, LRU eviction, counters."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.engine.page_pool import ROOT_KEY, PagePool
from jaxserve.schedule import NULL_PAGE

PAGE = 4


def register_chain(pool: PagePool, page_ids, pages_of_tokens) -> list[int]:
    """Registers consecutive full pages the way the scheduler does; returns their keys."""
    keys, parent = [], ROOT_KEY
    for page, tokens in zip(page_ids, pages_of_tokens):
        parent = pool.register(page, parent, tuple(tokens))
        keys.append(parent)
    return keys


def assert_counters_consistent(pool: PagePool) -> None:
    used = sum(1 for page in range(1, pool.num_pages) if pool.refcount(page) > 0)
    assert pool.num_used == used
    assert pool.num_used + pool.num_free + pool.num_cached == pool.num_pages - 1
    assert pool.refcount(NULL_PAGE) == 0


def test_null_page_is_never_handed_out():
    pool = PagePool(num_pages=6, page_size=PAGE)
    pages = pool.allocate(5)
    assert sorted(pages) == [1, 2, 3, 4, 5]
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.release(pages)
    assert NULL_PAGE not in pool.allocate(5)


def test_refcounts_follow_acquire_and_release():
    pool = PagePool(num_pages=4, page_size=PAGE)
    [page] = pool.allocate(1)
    register_chain(pool, [page], [(1, 2, 3, 4)])
    match = pool.match_prefix([(1, 2, 3, 4)], num_queried_tokens=5)
    pool.acquire_prefix(match)
    assert pool.refcount(page) == 2 and pool.num_used == 1
    pool.release([page])
    assert pool.refcount(page) == 1 and pool.num_used == 1
    pool.release([page])
    assert pool.refcount(page) == 0 and pool.num_cached == 1 and pool.num_used == 0
    with pytest.raises(RuntimeError):
        pool.release([page])
    assert_counters_consistent(pool)


def test_hit_requires_every_earlier_page_identical():
    pool = PagePool(num_pages=8, page_size=PAGE)
    a0, a1, b0 = (1, 2, 3, 4), (5, 6, 7, 8), (9, 9, 9, 9)
    pages = pool.allocate(2)
    keys = register_chain(pool, pages, [a0, a1])

    full = pool.match_prefix([a0, a1], num_queried_tokens=9)
    assert full.page_ids == tuple(pages) and full.keys == tuple(keys)
    assert pool.match_prefix([b0, a1], num_queried_tokens=9).num_pages == 0  # same page tokens, other parent
    assert pool.match_prefix([a0, b0], num_queried_tokens=9).page_ids == (pages[0],)
    assert pool.match_prefix([a1], num_queried_tokens=5).num_pages == 0  # a1 was only seen after a0


def test_duplicate_content_keeps_one_cached_copy():
    pool = PagePool(num_pages=8, page_size=PAGE)
    first, second = pool.allocate(2)
    key = pool.register(first, ROOT_KEY, (1, 2, 3, 4))
    assert pool.register(second, ROOT_KEY, (1, 2, 3, 4)) == key
    assert pool.is_keyed(first) and not pool.is_keyed(second)
    pool.release([first, second])
    assert pool.num_cached == 1 and pool.num_free == 6


def test_cached_pages_are_evicted_least_recently_released_first():
    pool = PagePool(num_pages=4, page_size=PAGE)
    contents = [(1, 1, 1, 1), (2, 2, 2, 2), (3, 3, 3, 3)]
    pages = pool.allocate(3)
    for page, tokens in zip(pages, contents):
        pool.register(page, ROOT_KEY, tokens)
    pool.release([pages[1], pages[0], pages[2]])
    assert pool.num_free == 0 and pool.num_cached == 3

    assert pool.allocate(1) == [pages[1]]
    assert pool.match_prefix([contents[1]], 4).num_pages == 0
    assert pool.match_prefix([contents[0]], 4).page_ids == (pages[0],)
    assert pool.allocate(1) == [pages[0]]
    assert pool.match_prefix([contents[2]], 4).page_ids == (pages[2],)
    assert_counters_consistent(pool)


def test_free_pages_are_used_before_cached_ones_are_evicted():
    pool = PagePool(num_pages=4, page_size=PAGE)
    [cached] = pool.allocate(1)
    pool.register(cached, ROOT_KEY, (7, 7, 7, 7))
    pool.release([cached])
    assert sorted(pool.allocate(2)) == sorted(set(range(1, 4)) - {cached})
    assert pool.match_prefix([(7, 7, 7, 7)], 4).page_ids == (cached,)


def test_cached_page_is_reused_after_its_owner_finished():
    pool = PagePool(num_pages=4, page_size=PAGE)
    pages = pool.allocate(2)
    register_chain(pool, pages, [(1, 2, 3, 4), (5, 6, 7, 8)])
    pool.release(reversed(pages))
    assert pool.num_cached == 2 and pool.num_used == 0

    match = pool.match_prefix([(1, 2, 3, 4), (5, 6, 7, 8)], num_queried_tokens=9)
    assert pool.num_evictable(match.page_ids) == 2
    pool.acquire_prefix(match)
    assert [pool.refcount(p) for p in pages] == [1, 1]
    assert pool.num_cached == 0 and pool.num_used == 2
    assert (pool.prefix_queried_tokens, pool.prefix_hit_tokens) == (9, 8)
    assert_counters_consistent(pool)


def test_disabled_cache_neither_keys_nor_matches():
    pool = PagePool(num_pages=4, page_size=PAGE, enable_prefix_caching=False)
    [page] = pool.allocate(1)
    assert pool.register(page, ROOT_KEY, (1, 2, 3, 4)) is None
    assert pool.match_prefix([(1, 2, 3, 4)], 5).num_pages == 0
    pool.release([page])
    assert pool.num_free == 3 and pool.num_cached == 0


def test_only_full_pages_are_registered():
    pool = PagePool(num_pages=4, page_size=PAGE)
    [page] = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.register(page, ROOT_KEY, (1, 2, 3))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=4), st.booleans()), max_size=25))
def test_random_sequences_only_hit_pages_with_their_exact_prefix(operations):
    """Sequences over a tiny alphabet collide often; every hit must hold exactly the looked-up prefix."""
    pool = PagePool(num_pages=7, page_size=2)
    content_of_page: dict[int, tuple] = {}  # what each keyed page was written with: its whole prefix
    live: list[list[int]] = []
    for page_tokens, finish_oldest in operations:
        pages_of_tokens = [tuple(page_tokens[i:i + 1] * 2) for i in range(len(page_tokens))]
        match = pool.match_prefix(pages_of_tokens, num_queried_tokens=2 * len(pages_of_tokens))
        for depth, page in enumerate(match.page_ids):
            assert content_of_page[page] == tuple(pages_of_tokens[:depth + 1])
        missing = len(pages_of_tokens) - match.num_pages
        if missing > pool.num_allocatable - pool.num_evictable(match.page_ids):
            continue
        pool.acquire_prefix(match)
        fresh = pool.allocate(missing)
        pages = list(match.page_ids) + fresh
        register_chain(pool, pages, pages_of_tokens)
        for depth, page in enumerate(fresh, start=match.num_pages):
            content_of_page[page] = tuple(pages_of_tokens[:depth + 1])
        live.append(pages)
        if finish_oldest:
            pool.release(reversed(live.pop(0)))
        assert_counters_consistent(pool)
    for pages in live:
        pool.release(reversed(pages))
    assert pool.num_used == 0
    assert_counters_consistent(pool)
