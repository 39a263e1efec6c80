"""A small thread-safe cache bounded by entry count and by pinned bytes, and a
memo of what a function computes of a class, which lives as long as the class."""

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar


_V = TypeVar("_V")


class BoundedCache(Generic[_V]):
    """A dict that evicts its oldest entries beyond `maxsize` entries or `maxbytes`
    bytes pinned by its values. A hit is one dict lookup, with no lock (dict reads
    are atomic) and no bookkeeping; insertions and evictions are locked."""

    def __init__(self, maxsize: int, maxbytes: int | None = None):
        self.maxsize = maxsize
        self.maxbytes = maxbytes
        self._values: dict[Hashable, _V] = {}
        self._sizes: dict[Hashable, int] = {}
        self._bytes = 0
        # Re-entrant: a weakref's callback, run by the collector in `put`, discards.
        self._lock = threading.RLock()
        # The hot path: the dict's own method (`TypeError` for an unhashable key).
        self.get = self._values.get

    def put(self, key: Hashable, value: _V, nbytes: int = 0) -> None:
        """Stores `value` under `key`, recording that it pins `nbytes` bytes."""
        with self._lock:
            self._bytes += nbytes - self._sizes.pop(key, 0)
            self._values.pop(key, None)
            self._values[key] = value
            self._sizes[key] = nbytes
            # A lone entry too: one that pins more than `maxbytes` is not kept.
            while self._values and (
                len(self._values) > self.maxsize
                or (self.maxbytes is not None and self._bytes > self.maxbytes)
            ):
                oldest = next(iter(self._values))
                del self._values[oldest]
                self._bytes -= self._sizes.pop(oldest)

    def discard(self, key: Hashable, value: _V | None) -> None:
        with self._lock:
            if value is not None and self._values.get(key) is value:
                del self._values[key]
                self._bytes -= self._sizes.pop(key)

    def setdefault(self, key: Hashable, value: _V) -> _V:
        with self._lock:
            if (existing := self._values.get(key)) is None:
                self.put(key, value)  # re-entrant
            return value if existing is None else existing

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self._sizes.clear()
            self._bytes = 0

    def values(self) -> list[_V]:
        return list(self._values.values())

    def __len__(self) -> int:
        return len(self._values)


def per_class(compute: Callable[[type], object]) -> Callable[[type], Any]:
    """`compute`, remembered per class as long as the class lives."""
    found: weakref.WeakKeyDictionary[type, Any] = weakref.WeakKeyDictionary()

    def lookup(cls: type) -> Any:
        try:
            return found[cls]
        except KeyError:
            found[cls] = value = compute(cls)
            return value

    return lookup
