"""A depth-bounded suffix trie over token sequences, with occurrence counts (no torch).

The index holds every substring of length <= ``max_depth`` (D) of the sequences added to
it, as a trie: node ``s`` (a token string, ``depth = len(s)``) stores

- ``count[s]``: how many times ``s`` occurs (end positions over all indexed sequences);
- ``out[s]``: how many of those occurrences are followed by another token (the sum of
  its children's counts), so ``count[s.c] / out[s]`` is the empirical probability that
  ``c`` follows ``s``;
- ``best[s]``: the child with the largest count (ties: the one incremented most
  recently, i.e. the continuation seen last), kept up to date on every increment;
- ``link[s]``: the node of ``s[1:]`` (the trie is closed under suffixes, so it exists).

Costs, independent of how much text is indexed:

- appending one token to a sequence touches the D windows that end at it: O(D);
- ``advance`` (the longest suffix of a stream that is in the trie, after one more token)
  is the Aho-Corasick transition over suffix links: amortised O(1) per token;
- drafting k tokens from a node follows ``best`` children: O(k) (plus suffix-link
  back-offs, at most D per draft token).

Memory: at most ``1 + D * tokens`` nodes for ``tokens`` indexed tokens (each appended token
creates at most D nodes). Removing a sequence decrements its windows (last position
first, longest window first, so a node's children and the nodes whose link points at it go
before it) and frees the nodes that reach count 0; their ids are reused. ``version`` grows
with every change, so that a cursor held outside (a node id, the longest match of some
stream) knows to re-sync: after an insertion a longer match may exist, after a removal
its node id may have been reused.

Storage is flat: typed arrays per field and one dict for the edges, keyed
``parent << 32 | token``; children also form a doubly linked sibling list so that a
node can be unlinked in O(1) and its parent's best child recomputed on eviction.

Two implementations of this one structure: ``SuffixIndex`` below (Python, the reference) and
``SuffixTrie`` in ``suffix_trie.cpp`` (C++, built on first use like the kit's CPU kernels,
``plugins/cpu_build.py``). They give the same node ids, counts, links, best children and
versions for the same calls, and the tests hold both to the same brute-force checks; the
engine takes the C++ one (``new_suffix_index``) because indexing every committed token in
Python costs 20-40 microseconds per token (4-6 in C++), 1-2% of a 64-row step on a 2-core CPU.
The C++ trie keeps a node's fields together (one struct per node, 48 bytes) and its edges in
an open-addressing table, so that a window costs a cache miss or two rather than one per
field: right after the target's forward pass nothing of a slot's trie is in cache.
"""
from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from dspark.plugins.cpu_build import CpuExtension

__all__ = ["SuffixIndex", "ROOT", "new_suffix_index", "native_available"]

ROOT = 0
_NONE = -1
_FIELDS = ("count", "out", "depth", "link", "parent", "token", "best", "stamp", "first", "next", "prev")


@dataclass
class _Sequence:
    ends: list[int] = field(default_factory=list)  # per position: the node of the longest window ending there
    head: int = ROOT  # node of the last min(D - 1, len) tokens (where the next token's windows hang)


class SuffixIndex:
    """Counts of all substrings up to ``max_depth`` tokens of the sequences added (module docstring)."""

    def __init__(self, max_depth: int = 24) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        for name in _FIELDS:
            setattr(self, name, array("q"))
        self.edges: dict[int, int] = {}
        self._free: list[int] = []
        self._seqs: dict[int, _Sequence] = {}
        self._next_seq = 0
        self._tick = 0  # increments so far: the recency stamp for ties
        self.version = 0  # grows with every extend / remove (cursors re-sync)
        self.num_tokens = 0
        for name in _FIELDS:  # the root, the empty string: depth 0, no parent, token, link or children
            getattr(self, name).append(ROOT if name in ("count", "out", "depth", "link", "stamp") else _NONE)

    # -- nodes ---------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        """Live nodes, the root included."""
        return len(self.count) - len(self._free)

    def nbytes(self) -> int:
        """Bytes held by the node arrays, the edge dict and the sequences' position lists."""
        arrays = sum(getattr(self, name).buffer_info()[1] * 8 for name in _FIELDS)
        ends = sum(sys.getsizeof(s.ends) for s in self._seqs.values())
        return arrays + sys.getsizeof(self.edges) + ends + sys.getsizeof(self._free)

    def _free_node(self, v: int) -> None:
        u = self.parent[v]
        del self.edges[(u << 32) | self.token[v]]
        p, n = self.prev[v], self.next[v]
        if p != _NONE:
            self.next[p] = n
        else:
            self.first[u] = n
        if n != _NONE:
            self.prev[n] = p
        self.count[v] = 0
        self._free.append(v)

    def child(self, u: int, token: int) -> int:
        """The node ``u.token``, or -1."""
        return self.edges.get((u << 32) | token, _NONE)

    def children(self, u: int) -> list[int]:
        out, v = [], self.first[u]
        while v != _NONE:
            out.append(v)
            v = self.next[v]
        return out

    def _rescan_best(self, u: int) -> None:
        best, key = _NONE, (0, -1)
        v = self.first[u]
        while v != _NONE:
            k = (self.count[v], self.stamp[v])
            if self.count[v] > 0 and k > key:
                best, key = v, k
            v = self.next[v]
        self.best[u] = best

    # -- sequences -----------------------------------------------------------------------------
    def add_sequence(self, tokens: Iterable[int] = ()) -> int:
        """Start a new sequence (optionally with its first tokens); returns its id."""
        sid = self._next_seq
        self._next_seq += 1
        self._seqs[sid] = _Sequence()
        self.extend(sid, tokens)
        return sid

    def sequence_length(self, sid: int) -> int:
        return len(self._seqs[sid].ends)

    @property
    def sequence_ids(self) -> list[int]:
        """Live sequences, oldest first."""
        return list(self._seqs)

    def last_node(self, sid: int) -> int:
        """The node of the sequence's last min(D, len) tokens (its own longest suffix)."""
        seq = self._seqs[sid]
        return seq.ends[-1] if seq.ends else ROOT

    def extend(self, sid: int, tokens: Iterable[int]) -> None:
        """Append tokens to sequence ``sid``: O(D) per token."""
        seq = self._seqs[sid]
        self.version += 1
        D = self.max_depth
        count, out, depth, link, best, stamp = self.count, self.out, self.depth, self.link, self.best, self.stamp
        parent, token, first, nxt, prv = self.parent, self.token, self.first, self.next, self.prev
        edges, get, free, ends = self.edges, self.edges.get, self._free, seq.ends
        for c in tokens:
            c = int(c)
            if c < 0 or c >= 1 << 32:
                raise ValueError(f"token ids must lie in [0, 2**32), got {c}")
            self._tick += 1
            tick = self._tick
            u, prev, head, deepest = seq.head, _NONE, _NONE, _NONE
            while True:  # the windows ending at c: (suffixes of head) + c, longest first
                key = (u << 32) | c
                v = get(key, _NONE)
                if v == _NONE:  # a new node u.c, created in line: this loop is the index's hot path
                    if free:
                        v = free.pop()
                        out[v] = 0
                        depth[v], parent[v], token[v], link[v] = depth[u] + 1, u, c, ROOT
                        best[v] = first[v] = prv[v] = _NONE
                    else:
                        v = len(count)
                        count.append(0)
                        out.append(0)
                        depth.append(depth[u] + 1)
                        link.append(ROOT)
                        parent.append(u)
                        token.append(c)
                        best.append(_NONE)
                        stamp.append(0)
                        first.append(_NONE)
                        nxt.append(_NONE)
                        prv.append(_NONE)
                    edges[key] = v
                    f = first[u]
                    nxt[v] = f
                    if f != _NONE:
                        prv[f] = v
                    first[u] = v
                count[v] += 1
                stamp[v] = tick
                out[u] += 1
                b = best[u]
                if b != v and (b == _NONE or count[v] >= count[b]):
                    best[u] = v
                if prev != _NONE:
                    link[prev] = v
                else:
                    deepest = v
                if head == _NONE and depth[v] < D:
                    head = v
                prev = v
                if u == ROOT:
                    break
                u = link[u]
            link[prev] = ROOT  # the one-token window
            seq.head = head
            ends.append(deepest)
            self.num_tokens += 1

    def remove(self, sid: int) -> None:
        """Drop a sequence: decrement its windows and free nodes whose count reaches 0."""
        seq = self._seqs.pop(sid)
        self.version += 1
        count, out, link, parent, best = self.count, self.out, self.link, self.parent, self.best
        for v in reversed(seq.ends):
            while v != ROOT:
                u, nxt = parent[v], link[v]
                count[v] -= 1
                out[u] -= 1
                if count[v] == 0:
                    self._free_node(v)
                    if best[u] == v:
                        self._rescan_best(u)
                elif best[u] == v:
                    self._rescan_best(u)
                v = nxt
            self.num_tokens -= 1

    # -- matching and drafting -------------------------------------------------------------------
    def advance(self, node: int, token: int) -> int:
        """The longest suffix of (stream . token) in the trie, given ``node`` = that of the stream."""
        D, depth, link = self.max_depth, self.depth, self.link
        token = int(token)
        while True:
            if depth[node] < D:
                v = self.edges.get((node << 32) | token, _NONE)
                if v != _NONE:
                    return v
            if node == ROOT:
                return ROOT
            node = link[node]

    def match(self, tokens: Sequence[int]) -> int:
        """The node of the longest suffix of ``tokens`` in the trie (reads the last D tokens)."""
        node = ROOT
        for t in tokens[-self.max_depth:]:
            node = self.advance(node, t)
        return node

    def draft(self, node: int, k: int, min_depth: int = 1) -> tuple[list[int], list[int], list[int], list[int]]:
        """Up to ``k`` drafts continuing the context whose longest suffix in the trie is ``node``.

        Each step backs off along suffix links to the longest suffix (of depth >= ``min_depth``)
        that has a continuation, then takes its most frequent next token. Returns (tokens,
        chosen-child counts, continuation counts of the nodes they were chosen at, those nodes'
        depths): the empirical probability of draft j is ``counts[j] / totals[j]``, seen after a
        matched context of ``depths[j]`` tokens."""
        toks, counts, totals, depths = [], [], [], []
        depth, link, best, out, count, token = self.depth, self.link, self.best, self.out, self.count, self.token
        D = self.max_depth
        for _ in range(k):
            while depth[node] >= min_depth and (depth[node] >= D or best[node] == _NONE):
                node = link[node]
            if depth[node] < min_depth or node == ROOT:
                break
            b = best[node]
            toks.append(token[b])
            counts.append(count[b])
            totals.append(out[node])
            depths.append(depth[node])
            node = b
        return toks, counts, totals, depths

    def node_string(self, node: int) -> list[int]:
        """The token string of ``node`` (tests and debugging)."""
        out = []
        while node != ROOT:
            out.append(self.token[node])
            node = self.parent[node]
        return out[::-1]


_NATIVE = CpuExtension("dspark_suffix_trie", lambda: Path(__file__).with_name("suffix_trie.cpp").read_text(),
                       "the suffix index runs in Python", python_module=True)


def native_available() -> bool:
    """Whether the C++ ``SuffixTrie`` builds here (built on the first call)."""
    return _NATIVE.load() is not None


def new_suffix_index(max_depth: int = 24, native: bool = True):
    """A suffix index of depth ``max_depth``: the C++ ``SuffixTrie`` where it builds and
    ``native`` is set, else the Python ``SuffixIndex`` (the same structure and answers)."""
    ext = _NATIVE.load() if native else None
    return ext.SuffixTrie(max_depth) if ext is not None else SuffixIndex(max_depth)
