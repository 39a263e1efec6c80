"""What filter_jit knows of the function it wraps: name, parameters, binding, labels."""

import functools as ft
import inspect
import types
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, TypeGuard

import equinox as eqx
import jax.tree_util as jtu
import numpy as np

from ._binding import (
    argument_label,
    Binder,
    BOUND,
    DefaultsGuard,
    FUNCTION,
    Keywords,
    kwdefault_values,
    LeafParameter,
    positional_names,
    same_kwdefaults,
    Shape,
)
from ._cache import per_class
from ._exact import exact_aux
from ._leaves import is_array
from ._partition import static_key
from ._structure import PyTreeDef
from ._trace import boxed_partial


def is_partial(fun: object) -> TypeGuard[ft.partial[Any]]:
    """Whether a call of `fun` is its partial's call (`jtu.Partial` included; not a
    subclass with a `__call__` of its own, an opaque callable)."""
    return is_partial_type(type(fun))


def is_partial_type(kind: type) -> bool:
    """Whether calls of instances of `kind` are partials' calls (see `is_partial`)."""
    return issubclass(kind, ft.partial) and kind.__call__ is ft.partial.__call__


def _inside(fun: object) -> tuple[Any, str] | None:
    """What a partial (`jtu.Partial` included) or a method (bound, an `eqx.Module`'s,
    any method-like object) calls, and the attribute that holds it; else `None`."""
    if is_partial(fun):
        return fun.func, ".func"
    func = getattr(fun, "__func__", None)
    return None if func is None else (func, ".__func__")


def bound_arrays(fun: object) -> list[np.ndarray]:
    """The NumPy arrays that a partial called as itself (a subclass with a
    `__call__` of its own, which is no pytree) binds, through tuples, lists and
    dicts: what its traces read that no call hands over as a leaf, and may change
    in place between calls."""
    if not isinstance(fun, ft.partial) or in_call_tree(fun):
        return []
    found: list[np.ndarray] = []
    pending: list[Any] = [*fun.args, *fun.keywords.values()]
    for _ in range(_MAX_BOUND_VALUES):
        if not pending:
            break
        value = pending.pop()
        if isinstance(value, np.ndarray):
            found.append(value)
        elif type(value) in (tuple, list):
            pending += value
        elif type(value) is dict:
            pending += value.values()
    return found


# A bound on the walk of `bound_arrays` (values looked at).
_MAX_BOUND_VALUES = 1000


class Opened(NamedTuple):
    """A partial's or a bound method's pieces: the callable inside, what it binds
    first by position (a method's receiver alone), and what it binds by keyword."""

    inside: Any
    args: tuple[Any, ...]
    keywords: dict[str, Any]


def opened(fun: object) -> Opened | None:
    """`fun` opened, as messages and texts show it: a partial (`jtu.Partial`
    included), or a bound method, of Python or of a builtin type (`[].append`, whose
    `__self__` is no module); `None` for any other callable."""
    if is_partial(fun):
        return Opened(fun.func, fun.args, fun.keywords)
    receiver = getattr(fun, "__self__", None)
    if type(fun) is types.MethodType or not (
        receiver is None or isinstance(receiver, types.ModuleType)
    ):
        return Opened(getattr(fun, "__func__", fun), (receiver,), {})
    return None


def unwrapped(fun: object) -> Any:
    """The callable under every partial and method of `fun` (see `_inside`)."""
    for _ in range(_MAX_DEPTH):
        inside = _inside(fun)
        if inside is None:
            break
        fun = inside[0]
    return fun


# Partials of methods of partials...: deeper than any program goes.
_MAX_DEPTH = 32


def python_function(
    fun: object, signed: bool = False
) -> tuple[types.FunctionType, str] | None:
    """The Python function a call of `fun` runs: under its partials and methods,
    else its class's `__call__`; and the expression reaching it from `f` (`"f"`,
    `"f.func"`, `"type(f).__call__"`). `None` for C code. `signed`: the function
    whose signature `inspect` gives, which for a partial subclass with a
    `__call__` of its own is its `func`'s."""
    path = "f"
    for _ in range(_MAX_DEPTH):
        if isinstance(fun, types.FunctionType):
            return fun, path
        if signed and isinstance(fun, ft.partial):
            fun, path = fun.func, path + ".func"
            continue
        inside = _inside(fun)
        if inside is None:
            call = getattr(type(fun), "__call__", None)
            if not isinstance(call, types.FunctionType):
                return None
            fun, path = call, f"type({path}).__call__"
            continue
        fun, path = inside[0], path + inside[1]
    return None


def name_of(fun: object) -> str:
    while is_partial(fun):
        fun = fun.func
    return getattr(fun, "__qualname__", None) or type(fun).__qualname__


def _defined_in_python(fun: object) -> bool:
    """Whether calling `fun` runs Python code, whose signature is exact (`np.add`
    refuses its own defaults `dtype=None` and `signature=None` together)."""
    return isinstance(fun, type) or python_function(fun) is not None


def signature_of(fun: Any, follow_wrapped: bool) -> inspect.Signature | None:
    """`fun`'s signature, or `None` (also for C code, not following `__wrapped__`)."""
    if not follow_wrapped and not _defined_in_python(fun):
        return None
    try:
        return inspect.signature(fun, follow_wrapped=follow_wrapped)
    except (TypeError, ValueError):  # builtins and other callables without one
        return None


def call_signature(fun: object) -> inspect.Signature | None:
    """The signature a call of `fun` binds to: its own (not its `__wrapped__`'s,
    which `eqx.filter_vmap(f)` advertises but may not accept), in which what a
    partial binds by keyword is `BOUND`, not a default: the partial passes its own
    value, so that partials of one function with other keywords bind alike."""
    return _bound_by(fun, signature_of(fun, follow_wrapped=False))


def _bound_by(
    fun: object, signature: inspect.Signature | None
) -> inspect.Signature | None:
    """`signature`, what the partial `fun` binds by keyword made `BOUND` (so that
    no signature keeps a partial's values alive). Any partial: `inspect` reads a
    subclass with a `__call__` of its own as a partial too, and its call passes
    its keywords itself."""
    if signature is None or not isinstance(fun, ft.partial) or not fun.keywords:
        return signature
    parameters = [
        p.replace(default=BOUND) if p.name in fun.keywords else p
        for p in signature.parameters.values()
    ]
    return signature.replace(parameters=parameters)


class DefaultsSource(NamedTuple):
    """Where a call of a function finds its defaults: `holder.__defaults__` and
    `holder.__kwdefaults__`, `holder` being the function reached from the callable
    `f` by the expression `path` (`"f"`, `"f.func"`, `"type(f).__call__"`)."""

    holder: weakref.ref[types.FunctionType]
    path: str


def defaults_source(fun: object) -> DefaultsSource | None:
    """Where calls of `fun` find their defaults, which may be reassigned at any
    time (`f.__defaults__ = ...`); `None` for a callable without Python defaults."""
    found = python_function(fun, signed=True)
    return None if found is None else DefaultsSource(weakref.ref(found[0]), found[1])


def in_call_tree(fun: object, treedef: PyTreeDef | None = None) -> bool:
    """Whether a wrapped callable is part of each call's pytree: a pytree (a Module,
    a `jtu.Partial`) or a leaf compared by value, not by identity (a function).
    `treedef`: its structure, where known."""
    structure = jtu.tree_structure(fun) if treedef is None else treedef
    leaf = structure.num_nodes == 1 and structure.num_leaves == 1
    return not leaf or type(fun).__eq__ is not object.__eq__


class Bound(jtu.Partial):
    """A `functools.partial` of a callable that is a pytree node (an `eqx.Module`,
    its bound method), as `filter_jit` holds it: the callable a child, partitioned
    like an argument, never auxiliary data (compared by `==`)."""


def _unflatten_bound(_: None, children: Any) -> Bound:
    func, args, keywords = children
    return Bound(func, *args, **keywords)


_FUNC, _ARGS, _KEYWORDS = map(jtu.GetAttrKey, ("func", "args", "keywords"))
jtu.register_pytree_with_keys(
    Bound,
    lambda p: (((_FUNC, p.func), (_ARGS, p.args), (_KEYWORDS, p.keywords)), None),
    _unflatten_bound,
    flatten_func=lambda p: ((p.func, p.args, p.keywords), None),
)


def as_held(fun: object) -> Any:
    """The callable `filter_jit` holds for `fun`, whose pytree each call partitions:
    a `functools.partial` as a `jtu.Partial` (its arguments children), of the
    callable itself where that is a pytree node (`Bound`), of a bound method's
    function with its receiver first; a bound method (an `eqx.Module`'s too) as a
    `Method`; any other callable (a partial subclass with a `__call__` of its own)
    as it is."""
    if type(fun) is jtu.Partial:
        # Its `func` is auxiliary data, held and compared by `==`: a bound method, a
        # partial (boxed by JAX) or a pytree node is a child of the partial instead.
        func = boxed_partial(fun.func) or fun.func
        if isinstance(func, ft.partial | types.MethodType) or _is_node(func):
            fun = ft.partial(func, *fun.args, **fun.keywords)
    if type(fun) is ft.partial:
        func, args = fun.func, fun.args
        if isinstance(func, types.MethodType):
            func, args = func.__func__, (func.__self__, *args)
        held = Bound if _is_node(func) else jtu.Partial
        return held(func, *args, **fun.keywords)
    # By the type: `isinstance` asks a Module for its `__class__`, in Python.
    if type(fun) is types.MethodType or _is_module_method(fun):
        method: Any = fun
        return Method(method.__func__, method.__self__)
    return fun


def _is_node(fun: object) -> bool:
    """Whether `fun` is a pytree node (an `eqx.Module`), not a leaf."""
    return not jtu.treedef_is_leaf(jtu.tree_structure(fun))


def own_dict(fun: object) -> dict[str, Any] | None:
    """`fun`'s instance `__dict__`, read past a `__getattribute__` of its class's
    (an `eqx.Module`'s, which costs a Python call and, for a name it lacks, an
    exception); `None` without one."""
    try:
        found = object.__getattribute__(fun, "__dict__")
    except AttributeError:
        return None
    return found if type(found) is dict else None


# What is read of a callable besides its call: its metadata, as `functools.wraps`
# copies it, and what its record (`Function`) reads. An instance may hold any of it
# in its own `__dict__`; else it is its class's (see `class_attributes`).
METADATA = (
    "__name__",
    "__qualname__",
    "__doc__",
    "__module__",
    "__annotations__",
    "__globals__",
)
RECORD_READS = (
    "__name__",
    "__qualname__",
    "__module__",
    "__wrapped__",
    "__signature__",
    "__func__",
)


_READ_BY_MODULE = eqx.Module.__getattribute__  # Equinox's own, or `object`'s


class ClassAttributes(NamedTuple):
    """What an instance of an `eqx.Module` class finds of `METADATA` and
    `RECORD_READS` in its class: `computed`, the names a descriptor gives (a
    property, which may read the instance); `found`, the others' values. An
    instance's own `__dict__` comes first."""

    computed: frozenset[str]
    found: dict[str, Any]
    # Its instances' metadata where it is its class's (see `class_read`), once.
    metadata: dict[str, Any]


@per_class
def class_attributes(cls: type) -> ClassAttributes | None:
    """See `ClassAttributes`; `None` but for an `eqx.Module` class without
    `__getattr__` (any other may compute any attribute)."""
    if not issubclass(cls, eqx.Module):
        return None
    names = {*METADATA, *RECORD_READS, "__getattr__", "__getattribute__"}
    # As an instance finds them: in the classes of its MRO, not its metaclass.
    found: dict[str, Any] = {}
    for base in reversed(cls.__mro__):
        found.update((n, vars(base)[n]) for n in names if n in vars(base))
    # Equinox's own `__getattribute__` changes what it reads of no dunder name.
    if "__getattr__" in found or found.pop("__getattribute__") is not _READ_BY_MODULE:
        return None
    computed = frozenset(n for n, v in found.items() if hasattr(type(v), "__get__"))
    return ClassAttributes(computed, {n: found[n] for n in found.keys() - computed}, {})


# What is read of a callable itself, past its call (see `class_read`).
_READS = frozenset((*METADATA, *RECORD_READS))


def class_read(fun: object) -> ClassAttributes | None:
    """The attributes of `fun`'s class where all that is read of `fun` itself
    (`METADATA`, `RECORD_READS`) is its class's: an `eqx.Module` whose class
    computes none of it and whose own `__dict__` holds none of it; else `None`."""
    attributes = class_attributes(type(fun))
    if attributes is None or attributes.computed:
        return None
    own = own_dict(fun)
    return attributes if own is not None and own.keys().isdisjoint(_READS) else None


def attribute_reader(fun: object) -> Callable[[str, Any], Any]:
    """`getattr(fun, ...)` for `METADATA` and `RECORD_READS`, past a Module's slow
    `__getattribute__` where its class says how (see `class_attributes`)."""
    attributes = class_attributes(type(fun))
    own = own_dict(fun)
    if attributes is None or own is None:
        return ft.partial(getattr, fun)
    computed, found, _ = attributes

    def read(name: str, default: Any) -> Any:
        if name in computed:
            return getattr(fun, name, default)
        return own[name] if name in own else found.get(name, default)

    return read


def _is_module_method(fun: object) -> bool:
    # `module.method`: a Module holding the function and the instance as fields.
    own = own_dict(fun) if issubclass(type(fun), eqx.Module) else None
    return (
        own is not None
        and isinstance(own.get("__func__"), types.FunctionType)
        and isinstance(own.get("__self__"), eqx.Module)
    )


class Method(jtu.Partial):
    """A bound method as `filter_jit` holds it: a `jtu.Partial` of the function and
    its `self`, which (unlike what a partial binds) is its first argument."""


jtu.register_pytree_node(
    Method,
    lambda p: ((p.args, p.keywords), p.func),
    lambda func, children: Method(func, *children[0], **children[1]),  # pyright: ignore[reportArgumentType]
)


def first_parameter(fun: object) -> str | None:
    """The first parameter of `fun`, if it takes an argument by position."""
    signature = signature_of(fun, follow_wrapped=True)
    names = [] if signature is None else positional_names(signature.parameters.values())
    return names[0] if names else None


def receiver_of(fun: object) -> str | None:
    """The name of the receiver (`self`, the first argument) of a callable whose
    leaves are its receiver's (a bound method, a callable Module: its first argument,
    whatever it holds), else `None`."""
    if type(fun) is Method:
        return first_parameter(fun.func) or "self"
    if is_partial(fun) or not in_call_tree(fun):
        return None
    func = getattr(fun, "__func__", None) or getattr(type(fun), "__call__", None)
    return first_parameter(func) or "self"


class Function:
    """The facts about a function that do not change between calls."""

    def __init__(self, fun: object):
        self.name = name_of(fun)
        self.fun_is_leaf = not in_call_tree(fun)
        signature = call_signature(fun)
        self.bind = Binder(signature, self.name)
        # The defaults the signature holds, as they were when it was read.
        self.defaults_source = defaults_source(fun)
        self.defaults = self._read_defaults()
        # `__kwdefaults__` is a dict: what it held when read.
        self.kwdefault_values = kwdefault_values(self.defaults[1])
        parameters = () if signature is None else signature.parameters.values()
        self._bound_positional = positional_names(parameters)
        # Whether a call may leave parameters to their defaults (not donated).
        self.has_defaults = any(
            p.default is not p.empty and p.default is not BOUND for p in parameters
        )
        self.receiver = receiver_of(fun)
        # Names, for messages and `donate=(names...)`, may come from `__wrapped__`.
        named = _bound_by(fun, signature_of(fun, follow_wrapped=True)) or signature
        self.parameters = () if named is None else tuple(named.parameters.values())
        # An `eqx.Module`'s fields, as its `__call__` names them: `self.weight`.
        self.fun_label = "self" if isinstance(fun, eqx.Module) else self.name
        # The parameters a `jtu.Partial` binds, to label its leaves: `self.w`.
        self.bound_names: tuple[str, ...] = ()
        if isinstance(fun, jtu.Partial):
            if (inner := signature_of(fun.func, follow_wrapped=True)) is not None:
                self.bound_names = tuple(inner.parameters)[: len(fun.args)]

    def _read_defaults(
        self,
    ) -> tuple[tuple[Any, ...] | None, dict[str, Any] | None]:
        holder = None if self.defaults_source is None else self.defaults_source.holder()
        if holder is None:
            return None, None
        return holder.__defaults__, holder.__kwdefaults__

    def defaults_guard(self) -> DefaultsGuard | None:
        """What a reader of calls taking defaults checks (`None`: nothing can)."""
        if self.defaults_source is None:
            return None
        return DefaultsGuard(
            self.defaults_source.path, *self.defaults, self.kwdefault_values
        )

    def defaults_changed(self) -> bool:
        """Whether the function's defaults were reassigned since it was read."""
        now = self._read_defaults()
        return (
            now[0] is not self.defaults[0]
            or now[1] is not self.defaults[1]
            or not same_kwdefaults(now[1], self.kwdefault_values)
        )

    def defaulted(self, shape: Shape) -> tuple[str, ...]:
        """The parameters that calls of `shape` (the number of positional arguments,
        then the keyword names) leave to defaults holding arrays."""
        args, kwargs = self.bind.find_sources(shape[0], shape[1:])
        found = [*zip(self._bound_positional, args), *kwargs.items()]
        return tuple(
            name
            for name, (kind, value) in found
            if kind == "default" and any(map(is_array, jtu.tree_leaves(value)))
        )

    def call_tree(
        self, fun: object, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> Any:
        """The pytree of a call: its bound arguments, after the function if a pytree."""
        call = Keywords(args, kwargs) if kwargs else args
        return call if self.fun_is_leaf else (fun, call)

    def split_call(
        self, fun: object, call: Any
    ) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        if not self.fun_is_leaf:
            fun, call = call
        if type(call) is Keywords:
            return fun, call.args, call.kwargs
        return fun, call, {}

    def _parameter(self, where: int | str) -> tuple[str, str]:
        """The parameter that receives positional argument `where` (an int) or
        keyword argument `where` (a str), and how to name the argument to a user."""
        return argument_label(self.parameters, where)

    def label(self, where: int | str) -> str:
        """How positional argument `where` (an int) or keyword argument `where` (a
        str) is named to a user."""
        return self._parameter(where)[1]

    def _function_label(self, path: jtu.KeyPath) -> str:
        # What a `jtu.Partial` binds, by the parameter that receives it.
        bound = len(self.bound_names)
        match path[1:3]:
            case (jtu.FlattenedIndexKey(key=0), jtu.SequenceKey(idx=i)) if i < bound:
                return self.bound_names[i] + jtu.keystr(path[3:])
            case (jtu.FlattenedIndexKey(key=1), jtu.DictKey(key=name)):
                return str(name) + jtu.keystr(path[3:])
        return self.fun_label + jtu.keystr(path[1:])

    def leaf_parameters(self, treedef: PyTreeDef) -> list[LeafParameter]:
        """For each leaf of a call with structure `treedef`: its parameter, its
        position if passed positionally, and its path in the user's terms."""
        call = treedef.unflatten([object() for _ in range(treedef.num_leaves)])
        found = []
        for path, _ in jtu.tree_flatten_with_path(call)[0]:
            if not self.fun_is_leaf:
                if path[0] == jtu.SequenceKey(0):
                    found.append(
                        LeafParameter(FUNCTION, None, self._function_label(path))
                    )
                    continue
                path = path[1:]
            if isinstance(path[0], jtu.GetAttrKey):  # Keywords.args or .kwargs
                path = path[1:]
            top, rest = path[0], path[1:]  # a `SequenceKey` or a `DictKey`
            index = top.idx if isinstance(top, jtu.SequenceKey) else None
            name, label = self._parameter(str(top.key) if index is None else index)
            found.append(LeafParameter(name, index, label + jtu.keystr(rest)))
        return found


def owner_of(fun: Any, by_class: bool = False) -> tuple[Any, Any]:
    """What owns the caches of `fun` (a callable as `as_held` holds it), and its key
    there (see `_owners`); `by_class`: `class_read(fun)` is known to be a record."""
    if issubclass(type(fun), jtu.Partial):  # not `isinstance`: see `as_held`
        owner, key = owner_of(fun.func)
        # A bound method (`Method`) apart from a partial (for donation).
        return owner, (type(fun), key, len(fun.args), tuple(fun.keywords))
    cls = type(fun)
    if cls is types.FunctionType:  # compared by identity: its caches its own
        return fun, None
    # A Module, part of each call's pytree (its fields keyed by each call): its
    # record is its class's but for what it holds or computes itself.
    if by_class or class_read(fun) is not None:
        return _call_owner(cls), ()
    attributes = class_attributes(cls)
    own = own_dict(fun)
    if attributes is not None and own is not None:
        names = [n for n in RECORD_READS if n in own or n in attributes.computed]
        read = attribute_reader(fun)
        return _call_owner(cls), tuple((n, _owner_key(read(n, None))) for n in names)
    leaves, treedef = jtu.tree_flatten(fun)
    if not in_call_tree(fun, treedef):
        # Compared by identity, and so called as itself: the owner of its own caches
        # (a method-like object made anew on each access is a function of its own).
        return fun, None
    # Its structure and static leaves, keyed as static arguments are (arrays aside).
    keys = [None if is_array(x) else (type(x), static_key(x)) for x in leaves]
    return _call_owner(cls), (treedef, exact_aux(treedef), tuple(keys))


def _owner_key(value: object) -> Any:
    """The key of `value`, read of a callable, among an owner's dispatchers, which
    live as long as the owner (a class's `__call__`): a callable (a method whose
    receiver holds a model's weights) by identity through a weak reference, as
    `jax.jit` keys a function; any other value as a static argument is keyed."""
    if callable(value) and not isinstance(value, type):
        try:
            return weakref.ref(value)
        except TypeError:
            pass
    return static_key(value)


@per_class
def _call_owner(cls: type) -> Any:
    """What owns the caches of the callable instances of `cls`: its `__call__`
    where that is a Python function, else the class."""
    call = inspect.getattr_static(cls, "__call__", None)
    return call if isinstance(call, types.FunctionType) else cls
