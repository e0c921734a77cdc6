"""The KV page pool (L1) with prefix reuse by chained page hashes (L2 and L3 below it: `kv_tiers`).

Pages hold `page_size` tokens of every layer's K and V. A full page whose KV is computed is *published*
under a chained key — key_0 = H(namespace, tokens[0:P]), key_i = H(key_{i-1}, tokens[iP:(i+1)P]) — so a
later request with the same prefix reuses it. Pages are reference counted; a page nobody uses but that
is published stays matchable in an LRU list until its memory is needed (then it is evicted); an
unpublished free page goes straight back to the free list. Page 0 is reserved as the scratch page that
padded CUDA-graph rows read, so it is never handed out.

Publishing is incremental: a caller that keeps the cursor `publish` returns (the pages of the request
already looked at) and hands it back as `since` visits only the pages that became full since — per
decode step O(pages added), not O(context). A page passed over because its content is already
published under another page (two requests with the same prompt) is remembered as that key's
*understudy*: when the other page is evicted or dropped, the understudy is published in its place at
once, as a walk from the first page on the request's next publish would have done. `pages_walked`
counts the pages publish looked at, so tests can check per-step work without timing anything.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence


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
        # held, unpublished pages whose content is published under another page: key → pages, page → key
        self._understudies: dict[bytes, list[int]] = {}
        self._understudy_key: dict[int, bytes] = {}
        self.pages_walked = 0  # pages `publish` looked at, in all (instrumentation: O(new pages) per step)
        # the tiers below (`kv_tiers.KVTiers`): told of each page published, and of pages handed out
        # again (before anything writes them)
        self.on_publish: Callable[[int, bytes], None] | None = None
        self.on_allocate: Callable[[list[int]], None] | None = None

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
    def match_prefix(self, tokens: Sequence[int], keys: list[bytes] | None = None) -> list[int]:
        """Pages holding the longest published prefix of `tokens`, leaving at least one token to compute
        (the step needs a query row for the next token's logits). The pages are referenced. `keys`, the
        request's page keys computed so far, is extended in place (the tiers below and `publish` reuse
        them: a long prompt is hashed once)."""
        full = (len(tokens) - 1) // self.page_size
        keys = extend_page_keys([] if keys is None else keys, tokens, self.page_size, self.namespace, full)
        pages = []
        for key in keys[:full]:
            page = self.page_of.get(key)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._take(page)
        return pages

    def publish(
        self,
        tokens: Sequence[int],
        pages: Sequence[int],
        computed: int,
        keys: list[bytes] | None = None,
        since: int = 0,
    ) -> int:
        """Publish the full pages of a request whose KV is computed (its first `computed` tokens), from
        page `since` on; returns the cursor to pass as `since` next time (pages before it were looked
        at). `keys`, the request's page keys computed so far, is extended in place (`extend_page_keys`).
        The cursor belongs to one list of pages: start again from 0 when the request's pages are
        replaced (preempted and readmitted); `since` = len(pages) is right for pages `match_prefix`
        returned (published already)."""
        if not 0 <= since <= len(pages):
            raise ValueError(f"publish: since ({since}) must be within the request's {len(pages)} pages")
        full = min(computed // self.page_size, len(pages))
        if full <= since:
            return since
        keys = extend_page_keys([] if keys is None else keys, tokens, self.page_size, self.namespace, full)
        walk = range(since, full)
        self.pages_walked += len(walk)
        for i in walk:
            page, key = pages[i], keys[i]
            if page in self.key_of or page in self._understudy_key:
                continue
            if key in self.page_of:  # the same content is published under another page: understudy it
                self._understudies.setdefault(key, []).append(page)
                self._understudy_key[page] = key
                continue
            self.key_of[page] = key
            self.page_of[key] = page
            if self.on_publish is not None:
                self.on_publish(page, key)
        return full

    def _unpublish(self, page: int) -> None:
        """Forget a published page nobody holds; a held understudy of its content takes its key."""
        key = self.key_of.pop(page)
        del self.page_of[key]
        understudies = self._understudies.pop(key, None)
        if understudies:
            heir = understudies.pop(0)
            del self._understudy_key[heir]
            self.key_of[heir] = key
            self.page_of[key] = heir
            if understudies:
                self._understudies[key] = understudies

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
                self._unpublish(page)
            self.ref[page] = 1
            pages.append(page)
        if self.on_allocate is not None:
            self.on_allocate(pages)
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
                    self._drop_understudy(page)
                    self._free.append(page)

    def _drop_understudy(self, page: int) -> None:
        """A page nobody holds any more is nobody's understudy (it will be handed out for other content)."""
        key = self._understudy_key.pop(page, None)
        if key is not None:
            understudies = self._understudies[key]
            understudies.remove(page)
            if not understudies:
                del self._understudies[key]

    def reset_prefix_cache(self) -> int:
        """Forget every published page nobody uses; returns how many were dropped."""
        dropped = list(self._cached_lru)
        self._cached_lru.clear()
        for page in dropped:
            self._unpublish(page)
            self._free.append(page)
        return len(dropped)
