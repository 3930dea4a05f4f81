"""What the entry points and integrations did, counted for ``rdnattention.stats()``.

A :class:`Tally` counts the calls that went as asked (:meth:`Tally.hit`) and, by reason, the ones
that took a deliberate other way (a fallback to torch, a padded copy): :meth:`Tally.add` counts
one and says whether it is the first of its reason since the last reset, so that the caller logs
or warns once per reason, in its own words and from its own frame. Thread-safe; a reset starts
the counts from zero and lets each reason be reported again."""

from __future__ import annotations

import itertools
import threading
from collections import Counter


class Tally:
    __slots__ = ("_lock", "_hits", "_read", "_reasons", "_reported", "hit")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reasons: Counter[str] = Counter()
        self._reported: set[str] = set()
        self._restart()

    def _restart(self) -> None:
        # The hits, counted by an itertools.count: one C call per hit, atomic without a lock (every
        # eager call of every entry point counts one). Reading one takes a value, so the reads are
        # counted too.
        self._hits = itertools.count()
        self._read = 0
        self.hit = self._hits.__next__  # counts a call that went as asked

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
            hits = next(self._hits) - self._read
            self._read += 1
            out = hits, dict(self._reasons)
            if reset:
                self._restart()
                self._reasons.clear()
                self._reported.clear()
        return out
