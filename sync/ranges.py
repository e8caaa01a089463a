"""Sets of integers kept as sorted, disjoint, inclusive ranges: ``[[1, 400], [402, 900]]``.

What the end-to-end acknowledgement speaks (issue 24): an ingest says which seqs
of a gateway's store it has landed; the gateway says which it knows are landed.
Seqs are sent oldest first, so the ranges merge into few; ``cap`` bounds them
where they do not (several ingests sharing one gateway's messages).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator


class RangeSet:
    """A set of ints as disjoint inclusive ranges, neighbours merged."""

    __slots__ = ("_his", "_los")

    def __init__(self, ranges: Iterable[tuple[int, int] | list[int]] = ()) -> None:
        self._los: list[int] = []
        self._his: list[int] = []
        for lo, hi in ranges:
            self.add(lo, hi)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return zip(self._los, self._his, strict=True)

    def __len__(self) -> int:
        """The number of ranges (not of integers)."""
        return len(self._los)

    def __bool__(self) -> bool:
        return bool(self._los)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RangeSet) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"RangeSet({[list(r) for r in self]})"

    def as_lists(self) -> list[list[int]]:
        return [[lo, hi] for lo, hi in self]

    def add(self, lo: int, hi: int) -> None:
        if hi < lo:
            raise ValueError(f"empty range [{lo}, {hi}]")
        los, his = self._los, self._his
        # Every range that touches or overlaps [lo - 1, hi + 1] merges with it.
        i = bisect.bisect_left(his, lo - 1)
        j = bisect.bisect_right(los, hi + 1)
        if i < j:
            lo, hi = min(lo, los[i]), max(hi, his[j - 1])
        los[i:j] = [lo]
        his[i:j] = [hi]

    def update(self, other: Iterable[tuple[int, int]]) -> None:
        for lo, hi in other:
            self.add(lo, hi)

    def covers(self, lo: int, hi: int) -> bool:
        """Every integer of [lo, hi] is in the set."""
        i = bisect.bisect_right(self._los, lo) - 1
        return i >= 0 and self._his[i] >= hi

    def count(self) -> int:
        """The number of integers in the set."""
        return sum(hi - lo + 1 for lo, hi in self)

    @property
    def high(self) -> int:
        """The largest integer in the set (0 if empty)."""
        return self._his[-1] if self._his else 0

    def discard_below(self, seq: int) -> None:
        """Forget every integer below ``seq`` (what nobody can ask about any more)."""
        i = bisect.bisect_left(self._his, seq)
        del self._los[:i], self._his[:i]
        if self._los and self._los[0] < seq:
            self._los[0] = seq

    def cap(self, n: int) -> None:
        """Keep at most the ``n`` highest ranges: what is dropped is the oldest, which
        the other side has most likely heard about already."""
        if len(self._los) > n:
            del self._los[: len(self._los) - n], self._his[: len(self._his) - n]
