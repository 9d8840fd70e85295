"""The engine's KV-cache slots: free, running, or retained for prefix reuse.

A finished sequence may keep its slot ("retained": its token ids and their KV) instead of freeing it, so that a
request whose prompt continues it (a multi-turn episode's next turn sends the whole episode so far) takes the slot
over and prefills only the tokens after the longest common prefix. Retained slots are slots nobody else wants: a
new sequence takes a free slot first, then evicts the least recently retained one, so retention never makes a
request wait. Only tokens whose KV exists count: a finished sequence's last sampled token was never run through
the model, so a continuation always prefills at least that token (and one prompt token is always left to run, to
get the next token's logits).

Lookup: each retained sequence is indexed by a chain of hashes of its first k blocks of `block` tokens (hash of the
previous hash and the block's ids), so a prompt is walked block by block to the deepest block some retained
sequence shares, then compared token by token (a hash collision cannot produce a wrong match). Prefixes shorter
than one block are not reused.

Weights: every retained sequence records `kv_version`, the oldest weight version its KV was computed with (the
version of the forward that prefilled its first token), and `take` reuses only KV no older than the version it is
given. The engine gives the current version and drops every retained slot at each update (`drop_retained`), in
`keep` mode too: the inference contract promises that a request arriving after an update's answer is generated
entirely with the new weights (the reason vLLM's prefix caching and SGLang's radix cache are off by default), and
prefix reuse keeps that promise: a reused prefix gives the logprobs a full prefill would.
"""

from __future__ import annotations

import collections
import heapq
from typing import Callable


class _Retained:
    __slots__ = ("slot", "tokens", "kv_version", "keys", "stamp")

    def __init__(self, slot: int, tokens: list[int], kv_version: int, keys: list[int], stamp: int):
        self.slot, self.tokens, self.kv_version, self.keys, self.stamp = slot, tokens, kv_version, keys, stamp


class Slots:
    def __init__(self, n: int, reset: Callable[[int], None], reuse: bool = True, block: int = 16,
                 exact_only: bool = False):
        """`reset(slot)` lets the runner drop what it keeps for a slot; `exact_only`: reuse only a retained
        sequence's whole KV (the generic HF runner cannot shorten its per-slot caches)."""
        self.n, self.reset, self.reuse, self.block, self.exact_only = n, reset, reuse, max(1, block), exact_only
        self.free = list(range(n))  # a min-heap: low slots first keeps decode slots contiguous
        self._lru: collections.OrderedDict[int, _Retained] = collections.OrderedDict()  # oldest first
        self._index: dict[int, set[int]] = {}  # chain hash of the first k blocks -> retained slots
        self._stamp = 0

    @property
    def retained(self) -> int:
        return len(self._lru)

    def available(self) -> int:
        return len(self.free) + len(self._lru)

    def _chain(self, tokens: list[int], blocks: int):
        h = 0
        for k in range(blocks):
            h = hash((h, tuple(tokens[k * self.block : (k + 1) * self.block])))
            yield h

    def alloc(self) -> int:
        """A slot for a new sequence: a free one, else the least recently retained one (evicted)."""
        if self.free:
            return heapq.heappop(self.free)
        slot, e = self._lru.popitem(last=False)
        self._unindex(slot, e)
        self.reset(slot)
        return slot

    def take(self, prompt: list[int], min_version: int) -> tuple[int, int, int] | None:
        """(slot, tokens reused, kv_version) of the retained sequence sharing the longest prefix with `prompt`
        (KV no older than `min_version`); that slot is no longer retained. None if no prefix of a block or more."""
        limit = len(prompt) - 1  # the last prompt token always runs: its logits give the first new token
        if not self.reuse or limit < self.block or not self._lru:
            return None
        levels = []  # (depth, retained slots sharing the prompt's first `depth` tokens by hash)
        for k, h in enumerate(self._chain(prompt, limit // self.block)):
            found = {s for s in self._index.get(h, ()) if self._lru[s].kv_version >= min_version}
            if not found:
                break
            levels.append(((k + 1) * self.block, found))
        best: tuple[int, int, int] | None = None  # (tokens, stamp, slot)
        for depth, cands in reversed(levels):  # the deepest first; shallower ones only if none there is usable
            for slot in cands:
                e = self._lru[slot]
                if e.tokens[:depth] != prompt[:depth]:
                    continue  # a hash collision
                n, m = depth, min(limit, len(e.tokens))
                while n < m and prompt[n] == e.tokens[n]:
                    n += 1
                if self.exact_only and n != len(e.tokens):
                    continue  # (exact_only) the whole retained sequence, or nothing
                if best is None or (n, e.stamp) > best[:2]:
                    best = (n, e.stamp, slot)
            if best is not None:
                break
        if best is None:
            return None
        n, _, slot = best
        e = self._lru.pop(slot)
        self._unindex(slot, e)
        return slot, n, e.kv_version

    def release(self, slot: int, tokens: list[int], kv_version: int | None) -> None:
        """A sequence ended; `tokens`: those whose KV is in its slot. Retained if reuse is on and they fill at
        least one block, else freed."""
        if not self.reuse or kv_version is None or len(tokens) < self.block:
            self._free(slot)
            return
        keys = list(self._chain(tokens, len(tokens) // self.block))
        self._stamp += 1
        self._lru[slot] = _Retained(slot, tokens, kv_version, keys, self._stamp)
        for h in keys:
            self._index.setdefault(h, set()).add(slot)

    def drop_retained(self) -> None:
        """Free every retained slot (at a weight update: their KV is of the replaced weights)."""
        for slot in list(self._lru):
            del self._lru[slot]
            self._free(slot)
        self._index.clear()

    def reset_all(self) -> None:
        """Every slot free (after a failed step, when nothing runs any more)."""
        self._lru.clear()
        self._index.clear()
        self.free = list(range(self.n))

    def _free(self, slot: int) -> None:
        heapq.heappush(self.free, slot)
        self.reset(slot)

    def _unindex(self, slot: int, e: _Retained) -> None:
        for h in e.keys:
            group = self._index.get(h)
            if group is not None:
                group.discard(slot)
                if not group:
                    del self._index[h]
