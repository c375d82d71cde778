"""A radix tree over token ids: which prefixes have a checkpoint. Pure Python."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


class Node:
    """The prefix spelled by the edges from the root to here (`depth` tokens)."""

    __slots__ = ("edge", "children", "parent", "depth", "value")

    def __init__(self, edge: list[int], parent: Node | None, depth: int) -> None:
        self.edge = edge  # tokens from the parent to here
        self.children: dict[int, Node] = {}  # first token of the child's edge -> child
        self.parent = parent
        self.depth = depth
        self.value: Any = None  # what is stored for this prefix (None: a branch point)


class RadixTree:
    """Prefixes of token sequences with a value each. Edges hold runs of tokens, so a
    walk costs one slice comparison per stored branch, not one step per token.

    Every leaf holds a value, and a node without a value has at least two children:
    `remove` prunes what a removal leaves behind.
    """

    def __init__(self) -> None:
        self.root = Node([], None, 0)

    def _path(self, tokens: list[int], limit: int) -> Iterator[Node]:
        """The nodes of the prefixes of tokens[:limit] the tree has, root first."""
        node = self.root
        yield node
        while node.depth < limit:
            child = node.children.get(tokens[node.depth])
            if child is None or child.depth > limit:
                return
            if tokens[node.depth : child.depth] != child.edge:
                return
            node = child
            yield node

    def find(self, tokens: list[int], length: int) -> Node | None:
        """The node of tokens[:length], if the tree has one."""
        *_, node = self._path(tokens, length)
        return node if node.depth == length else None

    def deepest(self, tokens: list[int], limit: int, accept: Callable[[Any], bool]) -> Any:
        """The value of the longest prefix of `tokens`, at most `limit` long, whose value
        `accept` takes; None if there is none."""
        best = None
        for node in self._path(tokens, limit):
            if node.value is not None and accept(node.value):
                best = node.value
        return best

    def insert(self, tokens: list[int], length: int) -> Node:
        """The node of tokens[:length], made (splitting an edge) if needed."""
        node = self.root
        while node.depth < length:
            first = tokens[node.depth]
            child = node.children.get(first)
            if child is None:
                leaf = Node(tokens[node.depth : length], node, length)
                node.children[first] = leaf
                return leaf
            # Tokens shared by the edge and tokens[node.depth:length].
            end = min(child.depth, length)
            shared = _common_prefix(child.edge, tokens, node.depth, end)
            if node.depth + shared == child.depth:
                node = child
                continue
            middle = Node(child.edge[:shared], node, node.depth + shared)
            child.edge = child.edge[shared:]
            child.parent = middle
            middle.children[child.edge[0]] = child
            node.children[first] = middle
            node = middle
        return node

    def remove(self, node: Node) -> None:
        """Drop `node`'s value and prune: a leaf without a value goes, a node without a
        value and one child merges into that child."""
        node.value = None
        while node is not self.root and node.value is None:
            parent = node.parent
            if not node.children:
                del parent.children[node.edge[0]]
            elif len(node.children) == 1:
                (child,) = node.children.values()
                child.edge = node.edge + child.edge
                child.parent = parent
                parent.children[node.edge[0]] = child
            else:
                return
            node = parent


def _common_prefix(edge: list[int], tokens: list[int], start: int, end: int) -> int:
    """How many leading tokens of `edge` equal tokens[start:end]."""
    n = end - start
    if edge[:n] == tokens[start:end]:
        return n
    # Whole runs of _RUN tokens while they match (each a C-speed slice comparison), then
    # bisection inside the first run that differs: linear in the shared length.
    lo = 0
    while lo + _RUN <= n and edge[lo : lo + _RUN] == tokens[start + lo : start + lo + _RUN]:
        lo += _RUN
    hi = min(lo + _RUN, n)  # edge[:lo] matches, edge[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if edge[lo:mid] == tokens[start + lo : start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


_RUN = 64


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    return _common_prefix(a, b, 0, n) if n else 0
