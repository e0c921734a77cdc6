"""The KV page pool (L1) with prefix reuse by chained page hashes.

Pages hold `page_size` tokens of every layer's K and V. A full page whose KV is computed is *published*
under a chained key — key_0 = H(namespace, tokens[0:P]), key_i = H(key_{i-1}, tokens[iP:(i+1)P]) — so a
later request with the same prefix reuses it. Pages are reference counted; a page nobody uses but that
is published stays matchable in an LRU list until its memory is needed (then it is evicted); an
unpublished free page goes straight back to the free list. Page 0 is reserved as the scratch page that
padded CUDA-graph rows read, so it is never handed out.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence


def page_keys(tokens: Sequence[int], page_size: int, namespace: bytes, full_pages: int) -> list[bytes]:
    """Chained keys of the first `full_pages` pages of `tokens`."""
    return extend_page_keys([], tokens, page_size, namespace, full_pages)


def extend_page_keys(
    keys: list[bytes], tokens: Sequence[int], page_size: int, namespace: bytes, full_pages: int
) -> list[bytes]:
    """Extend `keys` — the chained keys of the first len(keys) pages of `tokens` — in place to the first
    `full_pages` pages (a request's keys are computed once each, not again every step)."""
    previous = keys[-1] if keys else namespace
    for i in range(len(keys), full_pages):
        chunk = tokens[i * page_size : (i + 1) * page_size]
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(struct.pack(f"<{len(chunk)}I", *chunk))
        previous = digest.digest()
        keys.append(previous)
    return keys


class OutOfPages(RuntimeError):
    """The pool cannot give the pages asked for; `request_id` names the request that can never fit
    (the scheduler sets it when a request alone needs more pages than the pool has)."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class PagePool:
    def __init__(self, num_pages: int, page_size: int, namespace: bytes = b"hy3c-kv/v1") -> None:
        if num_pages < 2:
            raise ValueError("the KV cache needs at least 2 pages (page 0 is reserved)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.namespace = namespace
        self.ref = [0] * num_pages
        self.key_of: dict[int, bytes] = {}
        self.page_of: dict[bytes, int] = {}
        self._free = list(range(num_pages - 1, 0, -1))  # page 0: scratch
        self._cached_lru: OrderedDict[int, None] = OrderedDict()  # ref 0, published, evictable

    # ---- accounting --------------------------------------------------------------------------------
    @property
    def usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages that can be handed out now (free + evictable cached)."""
        return len(self._free) + len(self._cached_lru)

    @property
    def num_used(self) -> int:
        return self.usable - self.num_free

    def usage(self) -> float:
        return self.num_used / self.usable

    # ---- prefix reuse ------------------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int]) -> list[int]:
        """Pages holding the longest published prefix of `tokens`, leaving at least one token to compute
        (the step needs a query row for the next token's logits). The pages are referenced."""
        full = (len(tokens) - 1) // self.page_size
        pages = []
        for key in page_keys(tokens, self.page_size, self.namespace, full):
            page = self.page_of.get(key)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._take(page)
        return pages

    def publish(
        self, tokens: Sequence[int], pages: Sequence[int], computed: int, keys: list[bytes] | None = None
    ) -> None:
        """Publish every full page of a request whose KV is computed (first `computed` tokens). `keys`, the
        request's page keys computed so far, is extended in place (see `extend_page_keys`)."""
        full = min(computed // self.page_size, len(pages))
        keys = extend_page_keys([] if keys is None else keys, tokens, self.page_size, self.namespace, full)
        for page, key in zip(pages[:full], keys):
            if page in self.key_of:
                continue
            if key in self.page_of:  # the same content is already published under another page
                continue
            self.key_of[page] = key
            self.page_of[key] = page

    # ---- allocation --------------------------------------------------------------------------------
    def _take(self, page: int) -> None:
        if self.ref[page] == 0:
            self._cached_lru.pop(page, None)
        self.ref[page] += 1

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise OutOfPages(f"need {count} pages, {self.num_free} free")
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:  # evict the least recently used published page
                page, _ = self._cached_lru.popitem(last=False)
                del self.page_of[self.key_of.pop(page)]
            self.ref[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference per page. A sequence's pages are released last page first, so the LRU
        evicts the tail of a cached prefix before its head (a head page alone can still be matched)."""
        for page in reversed(pages):
            self.ref[page] -= 1
            if self.ref[page] < 0:
                raise RuntimeError(f"page {page} released twice")
            if self.ref[page] == 0:
                if page in self.key_of:
                    self._cached_lru[page] = None
                else:
                    self._free.append(page)

    def reset_prefix_cache(self) -> int:
        """Forget every published page nobody uses; returns how many were dropped."""
        dropped = list(self._cached_lru)
        for page in dropped:
            del self.page_of[self.key_of.pop(page)]
            self._free.append(page)
        self._cached_lru.clear()
        return len(dropped)
