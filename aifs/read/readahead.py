"""Per-open-file sequential detection with a growing readahead window."""

from __future__ import annotations


class Readahead:
    """Grows the window (doubling) while reads stay sequential.

    A read that starts where the furthest one so far ended, a little after it
    (the kernel may skip what its page cache already holds) or somewhat
    before it (the kernel's concurrent readahead requests arrive out of
    order), is sequential. Anything else resets the window: random readers
    fetch only what they ask for.
    """

    def __init__(self, initial: int, maximum: int) -> None:
        self.initial = initial
        self.maximum = max(initial, maximum)
        self.window = 0
        self._next = 0

    def observe(self, offset: int, size: int) -> int:
        """Record a read; return how many bytes past its end to prefetch."""
        sequential = self._next - self.maximum <= offset <= self._next + self.initial
        if sequential:
            self.window = min(self.maximum, max(self.initial, self.window * 2))
            self._next = max(self._next, offset + size)
        else:
            self.window = 0
            self._next = offset + size
        return self.window
