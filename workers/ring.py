"""A bounded log with absolute positions: readers ask for what follows the position
they have seen, and old entries fall off the front once ``capacity`` is reached."""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Ring(Generic[T]):
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self._items: deque[T] = deque(maxlen=capacity)
        self.total = 0
        """Entries ever appended: the position the next one takes."""

    def append(self, item: T) -> None:
        self._items.append(item)
        self.total += 1

    @property
    def first(self) -> int:
        """Position of the oldest entry still held."""
        return self.total - len(self._items)

    def since(self, position: int) -> list[T]:
        """Entries at ``position`` and after that are still held, oldest first."""
        skip = max(0, position - self.first)
        return list(self._items)[skip:]

    def __len__(self) -> int:
        return len(self._items)
