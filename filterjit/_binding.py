"""Binding a call's arguments to the function's parameters, defaults filled in."""

import inspect
import operator
from collections.abc import Iterable
from typing import Any, NamedTuple

import jax.tree_util as jtu


Args = tuple[Any, ...]
Kwargs = dict[str, Any]
Shape = tuple[Any, ...]  # a shape of call: `(len(args), *kwargs)`

# Shapes of call whose sources are kept (`**kwargs` may be given endless names).
_MAX_SHAPES = 64

# Where a bound argument comes from; those of a call's bound positional and keywords.
Source = tuple[str, Any]  # `("args", i)`, `("kwargs", name)` or `("default", value)`
Sources = tuple[list[Source], dict[str, Source]]


class LeafParameter(NamedTuple):
    """Which parameter a leaf of a call's pytree is passed to: its name (`FUNCTION`
    for a leaf of the wrapped callable's own: what a partial binds, a receiver),
    its position where passed positionally (`None` by keyword), and its path in
    the user's terms (`params['w']`, `self.weight`), for messages and tables."""

    parameter: str
    position: int | None
    label: str


FUNCTION = "<function>"


class DefaultsGuard(NamedTuple):
    """What a reader of calls that take defaults checks on every call: that the
    function reached from the callable `f` by the expression `path` still has the
    `defaults` and `kwdefaults` objects read (they may be reassigned), and that
    `kwdefaults`, a dict, still holds the very values `kwdefault_values` (it may be
    changed in place)."""

    path: str
    defaults: tuple[Any, ...] | None
    kwdefaults: dict[str, Any] | None
    kwdefault_values: tuple[Any, ...] = ()


def kwdefault_values(kwdefaults: dict[str, object] | None) -> tuple[Any, ...]:
    """The values of a function's `__kwdefaults__`, in order, to tell a change."""
    return () if kwdefaults is None else tuple(kwdefaults.values())


def same_kwdefaults(
    kwdefaults: dict[str, object] | None, read: tuple[object, ...]
) -> bool:
    """Whether `kwdefaults` holds the very values `read` (see `kwdefault_values`)."""
    if kwdefaults is None:
        return not read
    return len(kwdefaults) == len(read) and all(
        map(operator.is_, kwdefaults.values(), read)
    )


class _Bound:
    """The default a signature gives a parameter that the callable binds itself (a
    partial's keyword): the callable passes its own value, so the call passes none."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<bound by the callable>"


BOUND: Any = _Bound()


class Keywords:
    """The arguments of a call that has keyword arguments. A pytree node of its own
    type, so that `f(a, b, c=1)` and `f((a, b), {"c": 1})` differ in structure."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args: Args, kwargs: Kwargs):
        self.args = args
        self.kwargs = kwargs


_ARGS, _KWARGS = jtu.GetAttrKey("args"), jtu.GetAttrKey("kwargs")
jtu.register_pytree_with_keys(
    Keywords,
    lambda k: (((_ARGS, k.args), (_KWARGS, k.kwargs)), None),
    lambda _, children: Keywords(*children),
    flatten_func=lambda k: ((k.args, k.kwargs), None),
)


def positional_names(parameters: Iterable[inspect.Parameter]) -> list[str]:
    """The names of the `inspect.Parameter`s that take arguments by position."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in kinds]


def argument_label(
    parameters: Iterable[inspect.Parameter], where: int | str
) -> tuple[str, str]:
    """The parameter among `parameters` that receives positional argument `where`
    (an int) or keyword argument `where` (a str), and how to name the argument to
    a user: the parameter's name, `name[i]` for the `i`th argument `*name` takes,
    `<argument i>` where no parameter takes it."""
    if isinstance(where, str):
        return where, where
    parameters = tuple(parameters)
    positional = positional_names(parameters)
    if where < len(positional):
        return positional[where], positional[where]
    for p in parameters:
        if p.kind is p.VAR_POSITIONAL:
            return p.name, f"{p.name}[{where - len(positional)}]"
    return f"<argument {where}>", f"<argument {where}>"


class Binder:
    """`binder(args, kwargs)`: `(args, kwargs)` as `inspect.Signature.bind` and
    `apply_defaults` give them, so that `f(x)`, `f(x, 3)` and `f(x, n=3)` are one
    call; keywords sorted, as JAX sorts them, unless the function takes `**kwargs`.
    Where each bound value of a shape of call comes from is kept (`sources`): the
    fast path reads such calls without binding them."""

    def __init__(self, signature: inspect.Signature | None, name: str):
        self._signature = signature
        self._name = name
        self._sources: dict[Shape, Sources] = {}
        # Without a signature, calls are bound as given.
        self.sources = self._sources.get if signature is not None else _as_given
        parameters = () if signature is None else signature.parameters.values()
        self._sorts = signature is not None and all(
            p.kind is not p.VAR_KEYWORD for p in parameters
        )
        self._has_bound = any(p.default is BOUND for p in parameters)

    def __call__(self, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
        if self._signature is None:
            return args, kwargs
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(
                f"{self._name}(): {_bind_error(self._signature, args, kwargs, e)}"
            ) from None
        bound.apply_defaults()
        shape = (len(args), *kwargs)
        if shape not in self._sources and len(self._sources) < _MAX_SHAPES:
            self._sources[shape] = self.find_sources(len(args), tuple(kwargs))
        kwargs = bound.kwargs
        if self._has_bound:
            kwargs = {name: v for name, v in kwargs.items() if v is not BOUND}
        return bound.args, dict(sorted(kwargs.items())) if self._sorts else kwargs

    def find_sources(self, count: int, names: tuple[str, ...]) -> Sources:
        """Where the bound arguments of a call with `count` positional arguments
        and keyword arguments `names` come from (`TypeError` if none binds)."""
        assert self._signature is not None
        given = [object() for _ in range(count)]
        keyword = {name: object() for name in names}
        bound = self._signature.bind(*given, **keyword)
        bound.apply_defaults()
        found: dict[int, Source] = {id(p): ("args", i) for i, p in enumerate(given)}
        found.update({id(p): ("kwargs", name) for name, p in keyword.items()})
        # A default: the very object that `apply_defaults` would pass.
        source = lambda value: found.get(id(value), ("default", value))  # noqa: E731
        items = sorted(bound.kwargs.items()) if self._sorts else bound.kwargs.items()
        kwargs = {name: source(v) for name, v in items if v is not BOUND}
        return [source(v) for v in bound.args], kwargs


def _as_given(shape: Shape) -> Sources:
    """Where the values of a call of `shape` bound as given come from."""
    count, *names = shape
    return ([("args", i) for i in range(count)], {n: ("kwargs", n) for n in names})


def _bind_error(
    signature: inspect.Signature, args: Args, kwargs: Kwargs, error: TypeError
) -> str:
    """What is wrong with a call that does not bind, naming what was expected."""
    parameters = signature.parameters.values()
    kinds = {p.kind for p in parameters}
    names = ", ".join(p.name for p in parameters)
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        for name in kwargs:
            p = signature.parameters.get(name)
            if p is None or p.kind is p.POSITIONAL_ONLY:
                return (
                    f"got an unexpected keyword argument {name!r}; the parameters "
                    f"are ({names})."
                )
    if inspect.Parameter.VAR_POSITIONAL not in kinds:
        positional = positional_names(parameters)
        if len(args) > len(positional):
            return (
                f"takes {len(positional)} positional argument"
                f"{'' if len(positional) == 1 else 's'} ({', '.join(positional)}) but "
                f"{len(args)} were given."
            )
    return f"{error} (the parameters are ({names}))."
