"""KV page ownership on rank 0: the free list, reference counts, and the prefix cache.

A page holds the K/V of `page_size` consecutive tokens. A full page of known tokens can be found again
by its content: its key is a 128-bit BLAKE2b digest of (the key of the page before it, its token ids),
so equal keys mean equal prefixes (a wrong hit would silently change outputs; a 128-bit digest makes one
practically impossible, unlike Python's 64-bit `hash`). Such a page is shared by every request whose
prompt starts with that prefix; each holder counts one reference. A registered page whose count drops
to zero stays findable, on an LRU list, until `alloc` needs it: free pages are handed out first, then the
least recently released cached ones are evicted.

Only rank 0 has a PagePool; the other ranks see page ids in the step messages only.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

ROOT_KEY = b""  # the key "before" a request's first page


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The content key of a full page: its parent's key and its token ids."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def chain_keys(chain: list[bytes], tokens: Callable[[int, int], Sequence[int]], page_size: int,
               pages: int, start: int = 0) -> Iterator[bytes]:
    """The keys of a token sequence's full pages `start` (at most len(chain)) to `pages`, computed as they
    are asked for and kept in `chain`; tokens(start, n) gives the sequence's tokens. A request keeps its
    chain (its tokens only ever grow), so no key is computed twice, however often the request waits for
    pages and looks again."""
    for i in range(start, pages):
        if i == len(chain):
            chain.append(page_key(chain[-1] if chain else ROOT_KEY, tokens(i * page_size, page_size)))
        yield chain[i]


class PagePool:
    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool = True) -> None:
        self.num_pages, self.page_size, self.enabled = num_pages, page_size, prefix_cache
        self.free = list(range(num_pages - 1, -1, -1))  # pop() gives the lowest id first
        self.refs = [0] * num_pages
        self.page_of: dict[bytes, int] = {}  # content key -> page
        self.key_of: dict[int, bytes] = {}  # page -> content key (registered pages only)
        self.lru: OrderedDict[int, None] = OrderedDict()  # registered pages without references, oldest first

    @property
    def num_free(self) -> int:
        """Pages `alloc` can hand out: free ones and cached ones nobody references."""
        return len(self.free) + len(self.lru)

    @property
    def num_cached(self) -> int:
        return len(self.key_of)

    def alloc(self, n: int) -> list[int]:
        assert n <= self.num_free, f"asked for {n} KV pages, {self.num_free} free"
        out = []
        for _ in range(n):
            if self.free:
                page = self.free.pop()
            else:  # evict the least recently used cached page
                page, _ = self.lru.popitem(last=False)
                del self.page_of[self.key_of.pop(page)]
            self.refs[page] = 1
            out.append(page)
        return out

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; unreferenced pages go back to the free list, or stay cached."""
        for page in reversed(pages):
            assert self.refs[page] > 0, f"KV page {page} released more often than taken"
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.key_of:
                    self.lru[page] = None  # most recently used at the end
                else:
                    self.free.append(page)

    def register(self, page: int, key: bytes) -> None:
        """`page` (referenced) holds the full page with content `key`, or will once the step being issued
        ran."""
        if self.enabled and key not in self.page_of and page not in self.key_of:
            self.page_of[key] = page
            self.key_of[page] = key

    def match(self, chain: Iterable[bytes]) -> list[int]:
        """The cached pages holding the longest prefix of a sequence whose page keys are `chain`
        (`chain_keys`: read up to the first miss), each now referenced once more."""
        pages: list[int] = []
        for key in chain if self.enabled else ():
            page = self.page_of.get(key)
            if page is None:
                break
            if self.refs[page] == 0:
                del self.lru[page]
            self.refs[page] += 1
            pages.append(page)
        return pages

    def reset_refs(self) -> None:
        """Forget every reference (a new run: the last one may have ended early with requests holding pages);
        cached pages stay findable."""
        for page in range(self.num_pages):
            if self.refs[page]:
                self.refs[page] = 1
                self.release([page])

    def clear(self) -> None:
        """Forget every reference and every cached page: all pages free, rebuilt from nothing, so that a run
        cut anywhere (Ctrl-C inside `alloc` or `match`) loses no page."""
        self.free = list(range(self.num_pages - 1, -1, -1))
        self.refs = [0] * self.num_pages
        self.lru.clear()
        self.page_of.clear()
        self.key_of.clear()
