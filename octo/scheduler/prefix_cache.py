"""Prefix-cache index: a token trie from token prefixes to engine-owned KV handles, LRU by a byte budget.

The index only decides *what* to keep; the engine owns the KV bytes (``Engine.kv_save/kv_restore/
kv_free``). A lookup finds the longest common prefix between a new prompt and any cached entry, so a
cached ``system + user1 + reply`` serves a new ``system + user2`` prompt: the engine restores the
entry and truncates it to the shared ``system`` tokens.

Entries are keyed by LoRA adapter as well as tokens (``SamplingParams.adapter``): each adapter has its own trie, so
KV computed with one adapter (or without) never serves a sequence of another.

Invariant: every leaf of the trie holds an entry (nodes without entries below them are pruned), so any
node on a lookup path leads to an entry by following children.
Used from the engine thread only; ``stats()`` may be read from anywhere.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from octo.engine import KVHandle


class _Node:
    __slots__ = ("children", "parent", "token", "entry")

    def __init__(self, parent: _Node | None = None, token: int = -1) -> None:
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.token = token
        self.entry: KVHandle | None = None


class PrefixCache:
    def __init__(self, budget_bytes: int, free: Callable[[KVHandle], None], min_match: int = 4) -> None:
        self.budget = int(budget_bytes)
        self._free = free
        self.min_match = min_match
        self._roots: dict[str | None, _Node] = {None: _Node()}  # one trie per LoRA adapter (None: the base model)
        self._lru: OrderedDict[int, tuple[KVHandle, _Node]] = OrderedDict()  # id(handle) -> (handle, node)
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.tokens_reused = 0
        self.tokens_looked_up = 0
        self.evictions = 0
        self._shape = 0  # counts the trie's changes: a peek's answer holds until the next one
        self._last: tuple = (None,)  # the last peek: (tokens, len, max_len, adapter, shape, answer)

    # -- lookup ------------------------------------------------------------------------------------
    def lookup(self, tokens: list[int], max_len: int, adapter: str | None = None) -> tuple[KVHandle | None, int]:
        """The handle sharing the longest prefix with ``tokens[:max_len]`` (among those computed with ``adapter``)
        and that prefix's length."""
        self.tokens_looked_up += len(tokens)
        handle, depth = self.peek(tokens, max_len, adapter)
        if handle is None:
            self.misses += 1
            return None, 0
        self._lru.move_to_end(id(handle))
        self.hits += 1
        self.tokens_reused += depth
        return handle, depth

    def peek(self, tokens: list[int], max_len: int, adapter: str | None = None) -> tuple[KVHandle | None, int]:
        """What :meth:`lookup` would return, without counting it or touching the LRU order (admission asks it how
        much of a prompt the cache already holds). A prompt waiting for room is asked about at every step: while the
        trie has not changed, the answer for the same token list is the last one (a 20,000-token walk is ~1 ms)."""
        last = self._last
        if last[0] is tokens and last[1:5] == (len(tokens), max_len, adapter, self._shape):
            return last[5]
        answer = self._walk(tokens, max_len, adapter)
        self._last = (tokens, len(tokens), max_len, adapter, self._shape, answer)
        return answer

    def _walk(self, tokens: list[int], max_len: int, adapter: str | None) -> tuple[KVHandle | None, int]:
        node, depth = self._roots.get(adapter) or _Node(), 0
        for tok in tokens[:max_len]:
            child = node.children.get(tok)
            if child is None:
                break
            node, depth = child, depth + 1
        if depth < self.min_match:
            return None, 0
        while node.entry is None:  # any entry below shares the prefix; follow the most recent child
            node = next(reversed(node.children.values()))
        return node.entry, depth

    def restore_failed(self, n_tokens: int) -> None:
        """The engine could not restore the handle a lookup returned: count that lookup as a miss."""
        self.hits -= 1
        self.misses += 1
        self.tokens_reused -= n_tokens

    # -- insert / evict ----------------------------------------------------------------------------
    def insert(self, handle: KVHandle, adapter: str | None = None) -> None:
        """Take ownership of ``handle`` (KV computed with LoRA ``adapter``); frees it at once when it is redundant or
        over budget."""
        if handle.nbytes > self.budget or not handle.tokens:
            self._free(handle)
            return
        self._shape += 1
        node = self._roots.get(adapter)
        if node is None:
            node = self._roots[adapter] = _Node()
        for tok in handle.tokens:
            child = node.children.get(tok)
            if child is None:
                child = node.children[tok] = _Node(node, tok)
            node = child
        if node.children:  # a longer cached entry already covers this prefix: keep that one, fresher
            self._free(handle)
            self._touch_below(node)
            return
        if node.entry is not None:
            self._drop(node.entry, node, prune=False)
        # entries on the path are prefixes of the new one: it covers them
        anc = node.parent
        while anc is not None:
            if anc.entry is not None:
                self._drop(anc.entry, anc, prune=False)
            anc = anc.parent
        node.entry = handle
        self._lru[id(handle)] = (handle, node)
        self.bytes += handle.nbytes
        while self.bytes > self.budget and self._lru:
            old, old_node = next(iter(self._lru.values()))
            self._drop(old, old_node, prune=True)
            self.evictions += 1

    def evict_pool(self, keep: KVHandle | None = None) -> bool:
        """Evict the least recently used entry that holds cells of the engine's shared KV pool (``KVHandle.cells``),
        so that running sequences get them back, never ``keep`` (the entry a sequence being admitted will share);
        False when there is none."""
        for handle, node in self._lru.values():
            if handle.cells and handle is not keep:
                self._drop(handle, node, prune=True)
                self.evictions += 1
                return True
        return False

    def clear(self) -> None:
        for handle, node in list(self._lru.values()):
            self._drop(handle, node, prune=True)

    def _touch_below(self, node: _Node) -> None:
        while node.entry is None:
            node = next(reversed(node.children.values()))
        self._lru.move_to_end(id(node.entry))

    def _drop(self, handle: KVHandle, node: _Node, prune: bool) -> None:
        del self._lru[id(handle)]
        self._shape += 1
        node.entry = None
        self.bytes -= handle.nbytes
        self._free(handle)
        if prune:
            while node.parent is not None and not node.children and node.entry is None:
                del node.parent.children[node.token]
                node = node.parent

    # -- stats -------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        lookups = self.hits + self.misses
        return {
            "enabled": True,
            "entries": len(self._lru),
            "bytes": self.bytes,
            "budget_bytes": self.budget,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": round(self.hits / lookups, 4) if lookups else 0.0,
            "tokens_reused": self.tokens_reused,
            "tokens_looked_up": self.tokens_looked_up,
            "evictions": self.evictions,
            "pool_cells": sum(h.cells for h, _ in self._lru.values()),
        }
