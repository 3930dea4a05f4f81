"""What the entry points and integrations did, counted for ``rdnattention.stats()``.

A :class:`Tally` counts the calls that went as asked (:meth:`Tally.hit`) and, by reason, the ones
that took a deliberate other way (a fallback to torch, a padded copy): :meth:`Tally.add` counts
one and says whether it is the first of its reason since the last reset, so that the caller logs
or warns once per reason, in its own words and from its own frame. Thread-safe; a reset starts
the counts from zero and lets each reason be reported again."""

from __future__ import annotations

import threading
from collections import Counter


class Tally:
    __slots__ = ("_lock", "_hits", "_reasons", "_reported")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hits = 0
        self._reasons: Counter[str] = Counter()
        self._reported: set[str] = set()

    def hit(self) -> None:
        """Counts a call that went as asked."""
        with self._lock:
            self._hits += 1

    def add(self, reason: str, n: int = 1) -> bool:
        """Counts ``n`` of ``reason``; True where it is the first of that reason since the last
        reset (the caller reports it)."""
        with self._lock:
            self._reasons[reason] += n
            if reason in self._reported:
                return False
            self._reported.add(reason)
            return True

    def read(self, *, reset: bool = False) -> tuple[int, dict[str, int]]:
        """(the hits, {reason: count}), a copy; with ``reset``, the counts start again from zero and
        each reason is reported again."""
        with self._lock:
            out = self._hits, dict(self._reasons)
            if reset:
                self._hits = 0
                self._reasons.clear()
                self._reported.clear()
        return out
