"""A small thread-safe LRU cache bounded by entry count and by pinned bytes."""

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar


_V = TypeVar("_V")


class LRUCache(Generic[_V]):
    """Least-recently-used cache.

    Lookups take no lock: `OrderedDict` operations are atomic under the GIL, and a
    lookup that races an eviction just misses. Insertions and evictions are locked.
    """

    def __init__(self, maxsize: int, maxbytes: int | None = None):
        self.maxsize = maxsize
        self.maxbytes = maxbytes
        self._entries: OrderedDict[Hashable, tuple[_V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> _V | None:
        """The value stored under `key`, or `None`. Raises `TypeError` if `key`
        cannot be hashed."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        try:
            self._entries.move_to_end(key)
        except KeyError:  # evicted by another thread meanwhile
            pass
        return entry[0]

    def put(self, key: Hashable, value: _V, nbytes: int = 0) -> None:
        """Stores `value` under `key`, recording that it pins `nbytes` bytes, and
        evicts the least recently used entries beyond the bounds."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (value, nbytes)
            self._bytes += nbytes
            while len(self._entries) > 1 and (
                len(self._entries) > self.maxsize
                or (self.maxbytes is not None and self._bytes > self.maxbytes)
            ):
                _, (_, evicted_bytes) = self._entries.popitem(last=False)
                self._bytes -= evicted_bytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)
