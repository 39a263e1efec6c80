"""Who owns a function's caches: one dispatcher per function, as JAX and Equinox
see it, and per set of options. A function (any callable compared by identity) owns
its own; a bound method or a partial, the function it wraps (a partial whose bound
static values hold objects by identity, its own); any other callable (a
callable `eqx.Module`, a frozen dataclass), its class's `__call__`, keyed by its
structure and static leaves (one whose static fields hold objects by identity, its
own). Dispatchers live in the owner's own `__dict__`: dropping a function frees its
caches, and a cycle through them is garbage."""

import inspect
import threading
import types
import weakref
from typing import Any

import jax.tree_util as jtu

from ._cache import BoundedCache
from ._dispatch import Dispatcher
from ._exact import aux_holds_by_identity, holds_by_identity, is_weak_key, watched
from ._function import in_call_tree
from ._leaves import is_array
from ._options import Options
from ._partition import static_key
from ._structure import PyTreeDef


_ATTRIBUTE = "__filterjit_dispatchers__"

# Structures per owner (Equinox's `filter_vmap` wrapper class owns one per function).
_MAX_DISPATCHERS = 256


class _Holder:
    """The dispatchers an object owns, in its `__dict__`. Neither copied nor pickled
    with it: a copy is another function, with caches of its own."""

    __slots__ = ("owner", "dispatchers", "__weakref__")

    def __init__(self, owner: Any = None):
        self.owner = owner  # a weak reference to the owner, or the owner
        self.dispatchers: BoundedCache[Dispatcher] = BoundedCache(_MAX_DISPATCHERS)

    def owned_by(self, candidate: Any) -> bool:
        owner = self.owner
        return (owner() if isinstance(owner, weakref.ref) else owner) is candidate

    def __reduce__(self) -> tuple[Any, ...]:  # also what `copy` and `deepcopy` use
        return _Holder, ()


# Re-entrant: a weak reference's callback (`_forget`) may run inside it.
_lock = threading.RLock()
# The holders of owners without a `__dict__` (with `__slots__`, a builtin), by id.
_without_dict: dict[int, _Holder] = {}


def _holder(owner: Any) -> _Holder | None:
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


def _owner(fun: Any) -> tuple[Any, Any, list[Any]]:
    """What owns `fun`'s caches, its key there, and the objects the key holds weakly."""
    if isinstance(fun, jtu.Partial):
        if _holds_data_by_identity(*jtu.tree_flatten((fun.args, fun.keywords))):
            # Keys of its calls would hold those objects: caches of its own, which
            # die with it, not its function's, which may live for the process.
            return fun, None, []
        owner, key, weak = _owner(fun.func)
        # A bound method (`Method`) apart from a partial (for donation).
        return owner, (type(fun), key, len(fun.args), tuple(fun.keywords)), weak
    if not in_call_tree(fun):
        # Compared by identity, and so called as itself: the owner of its own caches
        # (a method-like object made anew on each access is a function of its own).
        return fun, None, []
    leaves, treedef = jtu.tree_flatten(fun)
    if _holds_data_by_identity(leaves, treedef):
        # Its key would hold them, as long as its class lives: its own caches.
        return fun, None, []
    call = inspect.getattr_static(type(fun), "__call__", None)
    owner = call if isinstance(call, types.FunctionType) else type(fun)
    # Its structure and static leaves, keyed as static arguments are (arrays aside).
    keys = [None if is_array(x) else (type(x), static_key(x)) for x in leaves]
    # A weak key was made: its object (a method's receiver) takes weak references.
    weak = [watched(x) for x, k in zip(leaves, keys) if k and is_weak_key(k[1])]
    return owner, (treedef, tuple(keys)), weak


def _holds_data_by_identity(leaves: list[Any], treedef: PyTreeDef) -> bool:
    """Whether a key of a pytree's static leaves and structure would hold an object
    compared by identity, or a jax Array, that the caller may drop (see
    `holds_by_identity`): in a static leaf, or in its structure's auxiliary data (a
    Module's static fields), which a key holds as they are."""
    statics = [leaf for leaf in leaves if not is_array(leaf)]
    return any(map(holds_by_identity, statics)) or aux_holds_by_identity(treedef)


def dispatcher_for(fun: Any, options: Options) -> Dispatcher:
    """The dispatcher shared by the wrappers of `fun` with `options`."""
    owner, key, weak = _owner(fun)
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
            if weak:
                found.drop_with(weak, lambda: dispatchers.discard(key, found))
        return found
