"""The radix trie of stored token sequences that the prefix cache and its disk tier look
prompts up in: a lookup costs the prompt's length, not the number of entries times it.

Compressed (an edge holds a run of tokens), so it has at most two nodes per entry however
long the prompts are. An entry is any object with a `tokens` tuple.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

Tokens = Tuple[int, ...]


class _Node:
    """A trie node: the entry stored for the sequence that ends here, if any, and the
    edges on, keyed by their first token."""

    __slots__ = ("entry", "edges")

    def __init__(self) -> None:
        self.entry: Optional[object] = None
        self.edges: Dict[int, Tuple[Tokens, "_Node"]] = {}  # first token -> (the edge's tokens, child)


class PrefixTrie:
    """Stored token sequences in a radix trie. Every node but the root holds an entry or
    branches (two or more edges): removal merges what would break that."""

    def __init__(self) -> None:
        self.root = _Node()

    def prefixes(self, tokens: Tokens) -> List[object]:
        """The entries whose sequence is a prefix of `tokens` (or equals it), shortest first."""
        found: List[object] = []
        node, depth = self.root, 0
        while True:
            if node.entry is not None:
                found.append(node.entry)
            edge = node.edges.get(tokens[depth]) if depth < len(tokens) else None
            if edge is None:
                return found
            label, child = edge
            end = depth + len(label)
            if tokens[depth:end] != label:
                return found
            node, depth = child, end

    def longest_usable(self, tokens: Tokens, whole: Callable[[object], bool]) -> Optional[object]:
        """The longest entry whose sequence is a strict prefix of `tokens`, or equals it where
        `whole(entry)` (a state kept with the logits after its last token can serve the very
        same prompt; one kept without, only longer ones)."""
        best = None
        for entry in self.prefixes(tokens):
            if len(entry.tokens) < len(tokens) or whole(entry):
                best = entry
        return best

    def shared_length(self, tokens: Tokens) -> int:
        """How many leading tokens of `tokens` some stored sequence starts with too."""
        _, depth, _, common = self._descend(tokens)
        return depth + common

    def next_tokens(self, tokens: Tokens) -> set:
        """The tokens that follow `tokens` in the stored sequences that extend it."""
        node, depth, label, common = self._descend(tokens)
        if depth + common < len(tokens):
            return set()  # no stored sequence extends all of `tokens`
        return {label[common]} if label is not None else set(node.edges)

    def _descend(self, tokens: Tokens) -> Tuple["_Node", int, Optional[Tokens], int]:
        """Follow `tokens` down as far as stored sequences share them -> (the last node
        reached whole, its depth, and the edge the walk stopped part way along with how many
        of its tokens matched; None and 0 where it stopped at the node)."""
        node, depth = self.root, 0
        while depth < len(tokens):
            edge = node.edges.get(tokens[depth])
            if edge is None:
                return node, depth, None, 0
            label, child = edge
            common = _common_length(label, tokens, depth)
            if common < len(label):
                return node, depth, label, common
            node, depth = child, depth + common
        return node, depth, None, 0

    def insert(self, entry: object) -> None:
        key = entry.tokens
        node, depth = self.root, 0
        while depth < len(key):
            edge = node.edges.get(key[depth])
            if edge is None:
                leaf = _Node()
                leaf.entry = entry
                node.edges[key[depth]] = (key[depth:], leaf)
                return
            label, child = edge
            common = _common_length(label, key, depth)
            if common < len(label):  # the key leaves the edge part way: split it there
                mid = _Node()
                mid.edges[label[common]] = (label[common:], child)
                node.edges[key[depth]] = (label[:common], mid)
                child = mid
            node, depth = child, depth + common
        node.entry = entry

    def remove(self, key: Tokens) -> None:
        path: List[Tuple[_Node, int]] = []  # (parent, the first token of the edge taken)
        node, depth = self.root, 0
        while depth < len(key):
            label, child = node.edges[key[depth]]
            path.append((node, key[depth]))
            node, depth = child, depth + len(label)
        node.entry = None
        # Drop a node left with nothing; merge one left with a single edge into its parent's edge.
        while path and node.entry is None and len(node.edges) < 2:
            parent, first = path.pop()
            label, _ = parent.edges[first]
            if node.edges:
                (rest, grandchild), = node.edges.values()
                parent.edges[first] = (label + rest, grandchild)
                return
            del parent.edges[first]
            node = parent


def _common_length(label: Tokens, key: Tokens, start: int) -> int:
    """How many leading tokens of `label` match `key` from `start`."""
    if key[start:start + len(label)] == label:
        return len(label)
    n = 0
    for a, b in zip(label, key[start:]):
        if a != b:
            break
        n += 1
    return n
