"""Who owns a function's caches: one dispatcher per function, as JAX and Equinox
see it, and per set of options. A function (any callable compared by identity) owns
its own; a bound method or a partial, the function it wraps; any other callable (a
callable `eqx.Module`, a frozen dataclass), its class's `__call__`: a Module keyed
by what its record reads of the instance itself (its fields are keyed by each call),
any other by its structure and static leaves as static arguments are keyed
(`_exact`), and so held until evicted by the bound on dispatchers per owner.
Dispatchers live in the owner's own `__dict__`: dropping a function frees its
caches, and a cycle through them is garbage."""

import threading
import weakref
from typing import Any

from ._cache import BoundedCache
from ._dispatch import Dispatcher
from ._function import owner_of
from ._options import Options


_ATTRIBUTE = "__filterjit_dispatchers__"

# Structures per owner (Equinox's `filter_vmap` wrapper class owns one per function).
_MAX_DISPATCHERS = 256


class _Holder:
    """The dispatchers an object owns, in its `__dict__`. Neither copied nor pickled
    with it: a copy is another function, with caches of its own."""

    __slots__ = ("owner", "dispatchers", "__weakref__")

    def __init__(self, owner: object = None):
        self.owner = owner  # a weak reference to the owner, or the owner
        self.dispatchers: BoundedCache[Dispatcher] = BoundedCache(_MAX_DISPATCHERS)

    def owned_by(self, candidate: object) -> bool:
        owner = self.owner
        return (owner() if isinstance(owner, weakref.ref) else owner) is candidate

    def __reduce__(self) -> tuple[Any, ...]:  # also what `copy` and `deepcopy` use
        return _Holder, ()


# Re-entrant: a weak reference's callback (`_forget`) may run inside it.
_lock = threading.RLock()
# The holders of owners without a `__dict__` (with `__slots__`, a builtin), by id.
_without_dict: dict[int, _Holder] = {}


def _holder(owner: object) -> _Holder | None:
    """The holder of what `owner` owns; `None` for one that takes neither an attribute
    nor a weak reference (a NumPy ufunc): its wrappers keep caches of their own."""
    namespace = getattr(owner, "__dict__", None)
    table: dict[Any, Any] = namespace if type(namespace) is dict else _without_dict
    has_dict = table is namespace
    key = _ATTRIBUTE if has_dict else id(owner)
    # `functools.wraps` copies `__dict__`, holder included: that one is another's.
    if type(holder := table.get(key)) is _Holder and holder.owned_by(owner):
        return holder
    with _lock:
        if type(holder := table.get(key)) is _Holder and holder.owned_by(owner):
            return holder
        # Without a `__dict__`: dropped with its owner, if still its (ids are reused).
        forget = None if has_dict else lambda _: _forget(key, holder)
        try:
            holder = _Holder(weakref.ref(owner, forget))
        except TypeError:
            if not has_dict:
                return None
            holder = _Holder(owner)  # a cycle through its own `__dict__`: garbage
        table[key] = holder
        return holder


def _forget(key: Any, holder: "_Holder | None") -> None:
    with _lock:
        if _without_dict.get(key) is holder:
            del _without_dict[key]


def dispatcher_for(fun: object, options: Options, by_class: bool) -> Dispatcher:
    """The dispatcher the wrappers of `fun` with `options` share (see `owner_of`)."""
    owner, key = owner_of(fun, by_class)
    if (holder := _holder(owner)) is None:
        return Dispatcher(fun, options)
    dispatchers = holder.dispatchers
    key = (key, options)
    try:
        found = dispatchers.get(key)
    except TypeError:  # a static leaf or a `compiler_options` dict: not shared
        return Dispatcher(fun, options)
    if found is not None:
        return found
    with _lock:
        if (found := dispatchers.get(key)) is None:
            found = Dispatcher(fun, options)
            dispatchers.put(key, found)
        return found
