"""The learned depth schedule's accept length at every depth, from one set of histograms
(auto_depth.py decides with it).

With top-k 1 a step at depth d drafts the first d tokens of the chain a step at the launch depth K
would draft: a request accepts min(A, d) of them, A being what it would accept at depth K, and
gets one token more (the target's own). So the tokens a request gets per step at any depth
d <= K follow from the distribution of A alone:

    tokens(d) = 1 + E[min(A, d)] = 1 + P(A >= 1) + ... + P(A >= d)

A step at depth d sees A only cut off at d: a request that accepted all d drafts says A >= d, not
how far beyond. The estimate is therefore the product-limit (Kaplan-Meier) one: the chance that
the j-th draft is accepted once the j - 1 before it were, P(A >= j | A >= j - 1), is taken from
the requests of the steps at depths >= j (the only ones that could show it) that accepted at least
j - 1, and P(A >= j) is the product of those chances up to j. Where no step has run as deep as j,
the chance of the deepest j measured carries on (a prior: exploration then measures it).

Kept per depth: a histogram of accepted drafts per request (0..d), forgetting as the threshold's
accept length does: each step of that depth keeps `memory` of the weight before it, and weighs
its requests. Pure Python (no torch, no sglang).
"""

from __future__ import annotations

from collections.abc import Sequence


class AcceptHistograms:
    """Per draft depth 1..max_depth, the recent requests by accepted drafts."""

    def __init__(self, max_depth: int, memory: float) -> None:
        if max_depth < 1 or not 0 < memory < 1:
            raise ValueError(f"AcceptHistograms: max_depth {max_depth} >= 1, memory {memory} in (0, 1)")
        self.max_depth = max_depth
        self.memory = memory
        # depth -> weight of the requests that accepted 0, 1, ..., depth drafts
        self.counts: dict[int, list[float]] = {d: [0.0] * (d + 1) for d in range(1, max_depth + 1)}

    def add(self, depth: int, num_correct_drafts_per_req: Sequence[int]) -> None:
        """One verified step at `depth`: each request's accepted drafts (more than `depth` counts as
        `depth`: the step drafted no more)."""
        if not 1 <= depth <= self.max_depth:
            raise ValueError(f"AcceptHistograms.add: depth {depth} not in 1..{self.max_depth}")
        counts = [num_correct_drafts_per_req.count(a) for a in range(depth + 1)]
        counts[depth] += len(num_correct_drafts_per_req) - sum(counts)
        self.add_counts(depth, counts)

    def add_counts(self, depth: int, counts: Sequence[float]) -> None:
        """One step at `depth` as its histogram: counts[a] requests accepted a drafts."""
        kept = self.counts[depth]
        for a, n in enumerate(counts):
            kept[a] = kept[a] * self.memory + n

    def conditional(self) -> list[float | None]:
        """Per j = 1..max_depth, P(A >= j | A >= j - 1) from the steps at depths >= j (None: no
        such step)."""
        out: list[float | None] = []
        for j in range(1, self.max_depth + 1):
            at_risk = accepted = 0.0
            for d in range(j, self.max_depth + 1):
                counts = self.counts[d]
                beyond = sum(counts[j:])
                accepted += beyond
                at_risk += beyond + counts[j - 1]
            out.append(accepted / at_risk if at_risk > 0 else None)
        return out

    def survival(self) -> list[float] | None:
        """[1, P(A >= 1), ..., P(A >= max_depth)]; None before any step drafted."""
        rates = self.conditional()
        known = [r for r in rates if r is not None]
        if not known:
            return None
        out, s, last = [1.0], 1.0, known[0]
        for rate in rates:
            last = rate if rate is not None else last
            s *= last
            out.append(s)
        return out

    def tokens_per_request(self) -> list[float] | None:
        """Per depth 0..max_depth, the tokens a request gets per step: 1 + E[min(A, depth)]."""
        survival = self.survival()
        if survival is None:
            return None
        out, total = [], 0.0
        for s in survival:
            total += s
            out.append(total)  # survival[0] = 1: the target's own token
        return out
