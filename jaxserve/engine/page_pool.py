"""`PagePool`: host bookkeeping of the fixed pool of KV pages — free list, refcounts and the prefix cache.

Every page is in exactly one of three states::

    free    refcount 0, no content key      handed out first
    used    refcount > 0                    held by one request, or shared by several with identical prefixes
    cached  refcount 0, keyed by content    reusable by a later request with the same prefix; evicted LRU

Page 0 is the null page: padded block-table entries point to it, so it is never handed out.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from collections.abc import Iterable

from jaxserve.schedule import NULL_PAGE
ROOT_KEY = 0  # parent key of a sequence's first page; no page is ever given this key

PageKey = int  # interned id of one full page's exact content chain


def prefix_root(lora_id: int) -> PageKey:
    """The parent key of a sequence's first page: KV computed under a LoRA adapter is that adapter's alone, so each
    adapter's chains start from a root of their own (negative: no page key is ever negative)."""
    return ROOT_KEY - lora_id
_Chain = tuple[PageKey, tuple[int, ...]]  # (key of the previous page, this page's tokens)


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    """The cached pages that hold a sequence's leading full pages, in order."""

    page_ids: tuple[int, ...] = ()  # physical page of each matched page of tokens
    keys: tuple[PageKey, ...] = ()  # content key of each matched page; the last is the parent of the next page
    num_queried_tokens: int = 0  # tokens the lookup was made for (prefix-cache statistics)

    @property
    def num_pages(self) -> int:
        return len(self.page_ids)


class PagePool:
    """Owns which KV pages are free, used or cached, and finds cached pages by content.

    A full page is keyed by its content chain (key of the previous page, its own tokens), interned to an integer
    id. Ids are never reused, so a key names one exact sequence of tokens from position 0 to the page's end: a hit is
    exact by construction (no hash can collide). The intern table holds only keys of pages still in the pool, so it
    is bounded by the pool size.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"the pool needs the null page and at least one more, got num_pages={num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refcounts = [0] * num_pages
        self._num_used = 0
        self._free: deque[int] = deque(range(NULL_PAGE + 1, num_pages))
        # Cached pages ordered from least to most recently released: eviction takes from the front.
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._key_of_chain: dict[_Chain, tuple[PageKey, int]] = {}  # content chain -> (key, page holding it)
        self._chain_of_page: dict[int, _Chain] = {}  # keyed page -> its chain, to unkey it on eviction
        self._next_key = ROOT_KEY + 1
        self.prefix_queried_tokens = 0  # tokens looked up in the prefix cache by admitted requests
        self.prefix_hit_tokens = 0  # of those, tokens found cached (their prefill was skipped)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self._num_used

    @property
    def num_allocatable(self) -> int:
        """Pages `allocate` can hand out now: free ones, then cached ones by eviction."""
        return len(self._free) + len(self._cached)

    def refcount(self, page_id: int) -> int:
        return self._refcounts[page_id]

    def is_keyed(self, page_id: int) -> bool:
        return page_id in self._chain_of_page

    def num_evictable(self, page_ids: Iterable[int]) -> int:
        """How many of these pages are cached now, i.e. stop being allocatable once acquired."""
        return sum(1 for page in page_ids if self._refcounts[page] == 0)

    def allocate(self, count: int) -> list[int]:
        """Hands out `count` fresh pages with refcount 1, evicting least recently released cached pages if needed."""
        if count > self.num_allocatable:
            raise RuntimeError(f"asked for {count} pages with only {self.num_allocatable} allocatable")
        pages = [self._take_page() for _ in range(count)]
        for page in pages:
            self._refcounts[page] = 1
        self._num_used += count
        return pages

    def release(self, page_ids: Iterable[int]) -> None:
        """Drops one reference to each page; unreferenced keyed pages become cached, the rest free.

        Pages released later are evicted later, so callers release a sequence's pages last-to-first: its first pages,
        the ones most likely shared by other prompts, stay cached longest.
        """
        for page in page_ids:
            if self._refcounts[page] <= 0:
                raise RuntimeError(f"page {page} released more often than acquired")
            self._refcounts[page] -= 1
            if self._refcounts[page] == 0:
                self._num_used -= 1
                if page in self._chain_of_page:
                    self._cached[page] = None
                else:
                    self._free.append(page)

    def match_prefix(self, page_tokens: Iterable[tuple[int, ...]], num_queried_tokens: int,
                     root: PageKey = ROOT_KEY) -> PrefixMatch:
        """Follows the key chain from `root` (see `prefix_root`) through consecutive full pages of tokens; stops at
        the first page not cached."""
        if not self.enable_prefix_caching:
            return PrefixMatch()
        pages: list[int] = []
        keys: list[PageKey] = []
        parent = root
        for tokens in page_tokens:
            hit = self._key_of_chain.get((parent, tokens))
            if hit is None:
                break
            parent, page = hit
            keys.append(parent)
            pages.append(page)
        return PrefixMatch(tuple(pages), tuple(keys), num_queried_tokens)

    def acquire_prefix(self, match: PrefixMatch) -> None:
        """Takes a reference to every matched page (cached ones leave the eviction queue) and counts the lookup."""
        for page in match.page_ids:
            if self._refcounts[page] == 0:
                del self._cached[page]
                self._num_used += 1
            self._refcounts[page] += 1
        self.prefix_queried_tokens += match.num_queried_tokens
        self.prefix_hit_tokens += match.num_pages * self.page_size

    def register(self, page_id: int, parent_key: PageKey, tokens: tuple[int, ...]) -> PageKey | None:
        """Records that `page_id` holds the full page `tokens` after the chain `parent_key`; returns its key.

        When another page already holds the same chain, that page stays the cached copy and its key is returned:
        this page remains unkeyed and is freed, not cached, when released. Returns None when caching is off.
        """
        if not self.enable_prefix_caching:
            return None
        if len(tokens) != self.page_size:
            raise ValueError(f"only full pages are cached: got {len(tokens)} tokens for page size {self.page_size}")
        chain = (parent_key, tokens)
        existing = self._key_of_chain.get(chain)
        if existing is not None:
            return existing[0]
        key = self._next_key
        self._next_key += 1
        self._key_of_chain[chain] = (key, page_id)
        self._chain_of_page[page_id] = chain
        return key

    def forget_contents(self) -> None:
        """No page may be found by its content any more: cached pages become free and pages in use unkeyed. For when
        the pool's KV is lost or was never written (a failed step: pages registered when its batch was built, a pool
        replaced by zeros)."""
        self._free.extend(self._cached)
        self._cached.clear()
        self._key_of_chain.clear()
        self._chain_of_page.clear()

    def _take_page(self) -> int:
        if self._free:
            return self._free.popleft()
        page, _ = self._cached.popitem(last=False)
        del self._key_of_chain[self._chain_of_page.pop(page)]
        return page
