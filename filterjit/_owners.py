"""Who owns a function's caches.

One dispatcher per function, as JAX and Equinox see it, and per set of options:

- a function (or any callable compared by identity) by its identity, never by
  `==`;
- a bound method or a partial by the function it wraps (the bound arguments are
  partitioned like any other);
- any other callable (an `eqx.Module` with a `__call__`, Equinox's `filter_vmap`
  wrappers, a frozen dataclass) by its structure: its pytree structure and its
  static leaves, keyed as static arguments are (arrays aside). Its class's
  `__call__` owns those dispatchers.

A dispatcher is kept alive by what owns it, and by nothing global: it lives in the
owner's own `__dict__`. So dropping the last reference to a function frees its
caches, and a cycle through them (a function passed as a static argument to its own
wrapper, an instance whose class holds the decorated method) is ordinary garbage.
"""

import inspect
import threading
import types
import weakref
from typing import Any

import jax.tree_util as jtu

from ._cache import BoundedCache
from ._dispatch import Dispatcher
from ._function import in_call_tree
from ._options import Options
from ._partition import is_array, static_key


_ATTRIBUTE = "__filterjit_dispatchers__"

# Structures per owner: an owner such as Equinox's `filter_vmap` wrapper class
# owns one per function it wraps.
_MAX_DISPATCHERS = 256


class _Holder:
    """The dispatchers an object owns, in that object's `__dict__`. Neither copied
    nor pickled with it: a copy is another function, with caches of its own."""

    __slots__ = ("owner", "dispatchers", "__weakref__")

    def __init__(self, owner: Any = None):
        self.owner = owner  # a weak reference to the owner, or the owner
        self.dispatchers: BoundedCache[Dispatcher] = BoundedCache(_MAX_DISPATCHERS)

    def owned_by(self, candidate: Any) -> bool:
        owner = self.owner
        return (owner() if isinstance(owner, weakref.ref) else owner) is candidate

    def __reduce__(self) -> tuple[Any, ...]:
        return _Holder, ()

    def __copy__(self) -> "_Holder":
        return _Holder()

    def __deepcopy__(self, memo: dict[int, Any]) -> "_Holder":
        return _Holder()


# Re-entrant: a weak reference's callback (`_forget`) may run inside it.
_lock = threading.RLock()
# Owners without a `__dict__` of their own (a class used as the function, an
# instance with `__slots__`, a builtin), by identity, each dropped when its owner
# dies: the holder refers to its owner only weakly, so nothing here keeps it
# alive.
_without_dict: dict[int, _Holder] = {}


def _holder(owner: Any) -> _Holder | None:
    """The holder of the dispatchers `owner` owns; `None` for an owner that can
    be neither given an attribute nor referred to weakly (a NumPy ufunc, an
    instance with `__slots__` and no `__weakref__`), whose wrappers then keep
    caches of their own, freed with them (`jax.jit` refuses such callables)."""
    namespace = getattr(owner, "__dict__", None)
    if type(namespace) is dict:
        holder = namespace.get(_ATTRIBUTE)
        # `functools.wraps` copies `__dict__`, holder included: that one is the
        # wrapped function's, not this one's.
        if type(holder) is _Holder and holder.owned_by(owner):
            return holder
        with _lock:
            holder = namespace.get(_ATTRIBUTE)
            if type(holder) is _Holder and holder.owned_by(owner):
                return holder
            try:
                holder = _Holder(weakref.ref(owner))
            except TypeError:  # a cycle through its own `__dict__`: garbage
                holder = _Holder(owner)
            namespace[_ATTRIBUTE] = holder
            return holder
    holder = _without_dict.get(id(owner))
    if holder is not None and holder.owned_by(owner):
        return holder
    with _lock:
        holder = _without_dict.get(id(owner))
        if holder is not None and holder.owned_by(owner):
            return holder
        key = id(owner)
        try:
            # Dropped with its owner (and only if still that owner's: an id may
            # be reused once the owner is gone).
            reference = weakref.ref(owner, lambda _: _forget(key, holder))
        except TypeError:
            return None
        holder = _Holder(reference)
        _without_dict[key] = holder
        return holder


def _forget(key: int, holder: "_Holder | None") -> None:
    with _lock:
        if _without_dict.get(key) is holder:
            del _without_dict[key]


def _structure_key(fun: Any) -> tuple[Any, list[Any]]:
    """A callable's structure and static leaves, keyed as static arguments are
    (arrays aside); and the objects it holds weakly."""
    leaves, treedef = jtu.tree_flatten(fun)
    keys: list[Any] = []
    weak: list[Any] = []
    for leaf in leaves:
        if is_array(leaf):
            keys.append(None)
            continue
        key = static_key(leaf)
        if isinstance(key, weakref.ref):
            weak.append(leaf)
        keys.append((type(leaf), key))
    return (treedef, tuple(keys)), weak


def _owner(fun: Any) -> tuple[Any, Any, list[Any]]:
    """What owns the caches of `fun`, what tells its dispatchers apart there, and
    the objects that key holds weakly."""
    if isinstance(fun, jtu.Partial):
        owner, key, weak = _owner(fun.func)
        # A bound method (`Method`) apart from a partial: only its `self` is an
        # argument, for donation.
        key = (type(fun), key, len(fun.args), tuple(fun.keywords))
        return owner, key, weak
    if not in_call_tree(fun):
        func = getattr(fun, "__func__", None)
        if func is not None:  # a method-like object other than a bound method
            # Its receiver is not in the call tree, so it keys the dispatcher, as
            # a static argument would be keyed (weakly, if compared by identity).
            receiver = getattr(fun, "__self__", None)
            key = static_key(receiver)
            weak = [receiver] if isinstance(key, weakref.ref) else []
            return func, (type(fun), type(receiver), key), weak
        return fun, None, []
    call = inspect.getattr_static(type(fun), "__call__", None)
    owner = call if isinstance(call, types.FunctionType) else type(fun)
    key, weak = _structure_key(fun)
    return owner, key, weak


def dispatcher_for(fun: Any, options: Options) -> Dispatcher:
    """The dispatcher shared by the wrappers of `fun` with `options`."""
    options_key = options.key()
    if options_key is None:  # options that cannot be compared: this wrapper's own
        return Dispatcher(fun, options)
    owner, key, weak = _owner(fun)
    holder = _holder(owner)
    if holder is None:
        return Dispatcher(fun, options)
    dispatchers = holder.dispatchers
    key = (key, options_key)
    try:
        found = dispatchers.get(key)
    except TypeError:  # a static leaf that cannot be hashed: not shared
        return Dispatcher(fun, options)
    if found is not None:
        return found
    with _lock:
        found = dispatchers.get(key)
        if found is None:
            found = Dispatcher(fun, options)
            dispatchers.put(key, found)
            if weak:
                found.drop_with(weak, lambda: dispatchers.discard(key, found))
        return found
