"""A drafted tree of tokens, its attention masks, and the walks that accept a path of it.

Node 0 is the root: the last verified token, emitted already but not yet in the cache. A check runs the
root and every node through the verifier in one block, in level order (a grafted branch, ``graft``,
after the rest), so node i sits at slot ``start + i`` and position ``start + depth(i)``; a node sees the
verified prefix and its own ancestors.

Acceptance follows the verifier down the tree. Greedy: the verifier's argmax at the current node; if a
child holds that token, move there, else that token is the bonus. Sampling (SpecExec-style, for a tree
whose children are the draft's deterministic top-k): at the current node, with the verifier's
probabilities p, try the children in order, accepting child c with probability p(c) / (mass left) and
otherwise removing c from p; when none is accepted, sample the bonus from what is left. The token that
comes out at each position is distributed exactly as p (P(c_k) = Π_{j<k}(1 − p̃(c_j)) · p̃(c_k) = p(c_k)),
and the next position is sampled from the verifier's distribution given that token, so the text is the
verifier's own sampling, only with several positions decided per check. Where a request shapes its logits
(bias, penalties, a schema: ``sampling.Shaping``), each node's row is shaped with the tokens of the path that led
there, before either walk reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitspec.config import SamplingParams
from splitspec.gpu_actor.sampling import Shaping, probabilities


def graphed_sizes(most: int) -> frozenset[int]:
    """The counts of text-drafted tokens a check takes where passes replay CUDA graphs: powers of two up to
    ``most``, since recorded passes are kept by token count (``SplitModel._replay``) and so stay few."""
    return frozenset(2**i for i in range(most.bit_length()))


def ancestors(parents: Sequence[int]) -> torch.Tensor:
    """bool [n, n]: [i, j] is True when node j is node i or one of its ancestors (parents[j] < j)."""
    n = len(parents)
    a = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        a[i] |= a[parents[i]]
    return a


@dataclass
class DraftTree:
    """Tokens of a drafted tree in level order (node 0 is the root)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]

    @property
    def nodes(self) -> int:
        return len(self.tokens) - 1

    def children(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            out[self.parents[i]].append(i)
        return out

    def path_tokens(self, nodes: Sequence[int]) -> list[int]:
        return [self.tokens[i] for i in nodes]

    def check_mask(self, prefix: int) -> torch.Tensor:
        """[n, prefix + n] for the verify pass: the whole prefix, then the tree's ancestor rows."""
        a = ancestors(self.parents)
        return torch.cat((torch.ones(len(self.tokens), prefix, dtype=torch.bool), a), dim=1)

    def positions(self, start: int) -> torch.Tensor:
        return torch.tensor(self.depths, dtype=torch.long) + start

    def graft(self, chain: Sequence[int], sizes: frozenset[int] | None = None) -> DraftTree:
        """This tree with ``chain`` (tokens proposed to follow the root) grafted on: down the nodes that
        already hold its tokens, then as new nodes below the last of them. Siblings stay distinct tokens,
        as the sampled walk needs; the new nodes come after the others (parents still before children), so
        that with ``sizes`` they are cut to the most of those counts that fit."""
        tokens, parents, depths = list(self.tokens), list(self.parents), list(self.depths)
        kids = self.children()
        node = 0
        for token in chain:
            same = [c for c in kids[node] if tokens[c] == token] if node < len(kids) else []
            if same:
                node = same[0]
                continue
            tokens.append(token)
            parents.append(node)
            depths.append(depths[node] + 1)
            node = len(tokens) - 1
        if sizes is not None:
            added = len(tokens) - len(self.tokens)
            keep = len(self.tokens) + max((n for n in sizes if n <= added), default=0)
            tokens, parents, depths = tokens[:keep], parents[:keep], depths[:keep]
        return DraftTree(tokens, parents, depths)


def accept_greedy(tree: DraftTree, logits: torch.Tensor, shaping: Shaping | None = None) -> tuple[list[int], int]:
    """(accepted nodes root-down, bonus token) following the verifier's argmax; ``logits`` [n, vocab]."""
    top = logits.argmax(-1).tolist() if shaping is None else None
    kids = tree.children()
    path: list[int] = []
    node = 0
    while True:
        best = top[node] if top is not None else int(shaping.apply(logits[node], tree.path_tokens(path)).argmax())
        nxt = next((c for c in kids[node] if tree.tokens[c] == best), None)
        if nxt is None:
            return path, best
        path.append(nxt)
        node = nxt


def accept_sampled(
    tree: DraftTree,
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    shaping: Shaping | None = None,
) -> tuple[list[int], int]:
    """(accepted nodes, bonus token) by the sequential rejection walk the module docstring describes."""
    kids = tree.children()
    path: list[int] = []
    node = 0
    while True:
        row = logits[node] if shaping is None else shaping.apply(logits[node], tree.path_tokens(path))
        p = probabilities(row, params)
        chosen = None
        for c in kids[node]:
            t = tree.tokens[c]
            mass = float(p.sum())
            if p[t] > 0 and float(torch.rand((), generator=generator, dtype=torch.float64)) * mass < float(p[t]):
                chosen = c
                break
            p[t] = 0.0
        if chosen is None:
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(chosen)
        node = chosen
