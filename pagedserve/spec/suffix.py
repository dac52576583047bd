"""Suffix decoding: drafts from suffix trees over the request's own tokens and the outputs of
earlier requests of this server.

Each tree is a suffix trie cut at `max_tree_depth`: every substring of length <= depth of its
texts is a path from the root, and each node counts how often that substring occurred. A
sequence's context suffix of length m (for every m the tree holds) leads to a node; from there
the draft follows the most frequent continuation while the product of its branch frequencies
stays >= min_token_prob. Of the candidates (every match length, both trees) the one with the
largest expected number of accepted tokens (the sum of those products) wins.

Trees grow incrementally: a text keeps its "active" nodes (its current suffixes of length
< depth), so appending one token costs `depth` child updates. The server-wide tree keeps the
outputs of the last `max_cached_requests` sequences; an evicted output is subtracted again.
"""
from __future__ import annotations

from collections import OrderedDict


class _Node:
    __slots__ = ("children", "count")

    def __init__(self):
        self.children: dict[int, _Node] | None = None
        self.count = 0


class SuffixTrie:
    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node()

    def extend(self, active: list, tokens) -> list:
        """Append tokens to a text whose current suffix nodes are `active` (shortest first);
        returns the new active list."""
        root, keep = self.root, self.depth - 1
        for t in tokens:
            new = []
            add = new.append
            for node in (root, *active):
                ch = node.children
                if ch is None:
                    child = _Node()
                    node.children = {t: child}
                else:
                    child = ch.get(t)
                    if child is None:
                        child = ch[t] = _Node()
                child.count += 1
                add(child)
            if len(new) > keep:
                del new[keep:]
            active = new
        return active

    def remove(self, tokens) -> None:
        """Subtract a text added with extend() from an empty active list."""
        root, keep = self.root, self.depth - 1
        active: list = []
        for t in tokens:
            new = []
            for node in [root] + active:
                child = node.children.get(t) if node.children else None
                if child is None:
                    continue
                child.count -= 1
                if child.count <= 0:
                    del node.children[t]
                new.append(child)
            active = new[:keep]

    def match(self, context: list[int]) -> list:
        """Nodes of the context's suffixes present in the trie, shortest first."""
        out = []
        n = len(context)
        for m in range(1, min(self.depth, n) + 1):
            node = self.root
            for t in context[n - m:]:
                node = node.children.get(t) if node.children else None
                if node is None:
                    return out  # a longer suffix contains this one: none of them is present either
            out.append(node)
        return out


def _continue(node: _Node, k: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent continuation from node: tokens and their summed path probabilities."""
    tokens, prob, score = [], 1.0, 0.0
    while len(tokens) < k and node.children:
        t, child = max(node.children.items(), key=lambda kv: kv[1].count)
        prob *= child.count / node.count
        if prob < min_prob:
            break
        tokens.append(t)
        score += prob
        node = child
    return tokens, score


class _SeqTree:
    __slots__ = ("trie", "active", "num_added")

    def __init__(self, depth: int):
        self.trie = SuffixTrie(depth)
        self.active: list = []
        self.num_added = 0


class SuffixProposer:
    def __init__(self, max_tree_depth: int, max_cached_requests: int, min_token_prob: float):
        self.depth = max_tree_depth
        self.max_cached = max_cached_requests
        self.min_prob = min_token_prob
        self.shared = SuffixTrie(max_tree_depth)
        self.cached_outputs: OrderedDict[int, list[int]] = OrderedDict()
        self.trees: dict[int, _SeqTree] = {}

    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        return [self._propose_one(s, k) for s, k in zip(seqs, ks)]

    def _propose_one(self, seq, k: int) -> list[int]:
        tree = self.trees.get(seq.seq_id)
        if tree is None:
            tree = self.trees[seq.seq_id] = _SeqTree(self.depth)
        tokens = seq.token_ids
        # the last token stays out of the request's tree until the next step: a match then only
        # finds earlier occurrences of the context (each with a continuation)
        upto = len(tokens) - 1
        if upto > tree.num_added:
            tree.active = tree.trie.extend(tree.active, tokens[tree.num_added:upto])
            tree.num_added = upto
        context = tokens[-(self.depth - 1):]
        best, best_score = [], 0.0
        candidates = tree.trie.match(context) + (self.shared.match(context) if self.cached_outputs else [])
        for node in candidates:
            draft, score = _continue(node, k, self.min_prob)
            if score > best_score:
                best, best_score = draft, score
        return best

    def release(self, seq, finished: bool = True) -> None:
        """Drop seq's tree; a finished sequence's output joins the server-wide tree (the oldest
        cached output leaves past the cap)."""
        self.trees.pop(seq.seq_id, None)
        if not finished or self.max_cached == 0 or seq.seq_id in self.cached_outputs:
            return
        out = seq.output_token_ids
        if not out:
            return
        self.shared.extend([], out)
        self.cached_outputs[seq.seq_id] = out
        while len(self.cached_outputs) > self.max_cached:
            _, old = self.cached_outputs.popitem(last=False)
            self.shared.remove(old)
