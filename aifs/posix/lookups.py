"""How many references the kernel holds to each inode: one per LOOKUP answer,
READDIRPLUS entry, CREATE, MKNOD ..., less what FORGET gives back. An inode
the kernel still knows is not dropped (``Inodes.free_if_unused``).

A walk hands the kernel an entry for every file of the tree, so this table
holds one count per file walked until the kernel forgets them. A ``dict`` of
inode -> count costs about 70 bytes per inode (an int object, a slot, its
index): 700 MB at 10 M files. Inode numbers come from one counter, a
directory's listing at a time, so the numbers the kernel holds are dense: their
counts are kept in pages of ``PAGE`` consecutive numbers, a byte each (counts
of 255 and more in a dict beside), about 1.1 bytes per inode. Numbers whose
page holds fewer than ``DENSE`` of them stay in a plain dict (with a count of
them per page): a number with no neighbours held costs about twice what a
dict alone did, one in a walked directory ~60 times less.
"""

from __future__ import annotations

BITS = 10
PAGE = 1 << BITS  # inode numbers per page
MASK = PAGE - 1
DENSE = 32  # numbers held in one page before it is made (a page: ~1.1 KB)
FULL = 255  # a page byte at this value: the count is in ``_big``
ONES = b"\1" * PAGE


class LookupCounts:
    """inode -> references the kernel holds (0: none), with the dict reads
    callers use: ``counts.get(ino)``, ``counts[ino]``, ``ino in counts``."""

    def __init__(self) -> None:
        self._pages: dict[int, bytearray] = {}  # page number -> a count per number
        self._big: dict[int, int] = {}  # inode -> count, where its page byte is FULL
        self._loose: dict[int, int] = {}  # inode -> count, where its page is not made
        self._held: dict[int, int] = {}  # page number -> numbers in it with a count

    def get(self, ino: int, default: int = 0) -> int:
        page = self._pages.get(ino >> BITS)
        if page is None:
            return self._loose.get(ino, default)
        count = page[ino & MASK]
        if count == FULL:
            return self._big[ino]
        return count or default

    def __getitem__(self, ino: int) -> int:
        count = self.get(ino)
        if not count:
            raise KeyError(ino)
        return count

    def __contains__(self, ino: object) -> bool:
        return isinstance(ino, int) and self.get(ino) > 0

    def __len__(self) -> int:
        return sum(self._held.values())

    def add(self, ino: int, n: int = 1) -> None:
        """The kernel took ``n`` more references to ``ino``."""
        number = ino >> BITS
        page = self._pages.get(number)
        if page is None:
            count = self._loose.get(ino, 0)
            if count:
                self._loose[ino] = count + n
                return
            held = self._held[number] = self._held.get(number, 0) + 1
            if held < DENSE:
                self._loose[ino] = n
                return
            page = self._make_page(number)
        else:
            count = page[ino & MASK]
            if count == FULL:
                self._big[ino] += n
                return
            if not count:
                self._held[number] += 1
        self._set(page, ino, page[ino & MASK] + n)

    def add_range(self, first: int, count: int) -> None:
        """One more reference to each of ``count`` numbers from ``first`` (the
        files of a READDIRPLUS page from a listing are numbered one by one):
        where none of them was held, their page's bytes are set in one step."""
        end = first + count
        while first < end:
            number = first >> BITS
            stop = min(end, (number + 1) << BITS)
            page = self._pages.get(number)
            if page is None and self._held.get(number, 0) + stop - first >= DENSE:
                page = self._make_page(number)
            low, high = first & MASK, ((stop - 1) & MASK) + 1
            if page is not None and page.count(0, low, high) == high - low:
                page[low:high] = ONES[:high - low]
                self._held[number] = self._held.get(number, 0) + high - low
            else:
                for ino in range(first, stop):
                    self.add(ino)
            first = stop

    def drop(self, ino: int, n: int) -> int:
        """The kernel gave ``n`` references to ``ino`` back; the count left
        (0: it forgot the inode; more than it held counts as all)."""
        number = ino >> BITS
        page = self._pages.get(number)
        if page is None:
            count = self._loose.pop(ino, 0)
            if count > n:
                self._loose[ino] = count - n
                return count - n
        else:
            count = page[ino & MASK]
            if count == FULL:
                count = self._big.pop(ino)
            if count > n:
                self._set(page, ino, count - n)
                return count - n
            page[ino & MASK] = 0
        if count:
            self._release(number)
        return 0

    def _set(self, page: bytearray, ino: int, count: int) -> None:
        if count >= FULL:
            page[ino & MASK] = FULL
            self._big[ino] = count
        else:
            page[ino & MASK] = count
            self._big.pop(ino, None)

    def _make_page(self, number: int) -> bytearray:
        """The page of ``number``, with its loose counts moved in."""
        page = self._pages[number] = bytearray(PAGE)
        first = number << BITS
        for ino in range(first, first + PAGE):
            count = self._loose.pop(ino, 0)
            if count:
                self._set(page, ino, count)
        return page

    def _release(self, number: int) -> None:
        """One number of page ``number`` no longer held; an empty page goes."""
        held = self._held[number] - 1
        if held:
            self._held[number] = held
            return
        del self._held[number]
        self._pages.pop(number, None)
