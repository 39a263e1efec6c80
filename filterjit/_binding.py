"""Binding a call's arguments to the function's parameters, defaults filled in."""

import inspect
from collections.abc import Callable
from typing import Any

from ._codegen import compile_function


Args = tuple[Any, ...]
Kwargs = dict[str, Any]

# Bound on the number of shapes of call (positional count, keyword names) that
# get a plan: a function taking `**kwargs` may be called with endless names.
_MAX_PLANS = 64


class _Placeholder:
    __slots__ = ()


# Where a bound argument comes from: `("args", i)`, the call's positional argument
# `i`; `("kwargs", name)`, its keyword argument `name`; `("default", value)`, the
# parameter's default.
Source = tuple[str, Any]
# The sources of a call's bound positional and keyword arguments.
Sources = tuple[list[Source], dict[str, Source]]


class Binder:
    """`binder(args, kwargs)` gives `(args, kwargs)` as `inspect.Signature.bind`
    followed by `apply_defaults` would, so that `f(x)`, `f(x, 3)` and `f(x, n=3)`
    are one call.

    `Signature.bind` costs microseconds. For each shape of call (the number of
    positional arguments and the keyword names, in order) the binder binds
    placeholders once and records where each bound value comes from (`sources`),
    as a generated function such as `lambda a, k: ((a[0], k['n']), {'mode': 'a'})`.
    """

    def __init__(self, signature: inspect.Signature | None, name: str):
        self._signature = signature
        self._name = name
        self._plans: dict[tuple[Any, ...], Callable[[Args, Kwargs], Any]] = {}
        self._sources: dict[tuple[Any, ...], Sources] = {}

    def __call__(self, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
        plan = self._plans.get((len(args), *kwargs))
        if plan is not None:
            return plan(args, kwargs)
        if self._signature is None:
            return args, kwargs
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(
                f"{self._name}(): {_bind_error(self._signature, args, kwargs, e)}"
            ) from None
        bound.apply_defaults()
        if len(self._plans) < _MAX_PLANS:
            shape = (len(args), *kwargs)
            self._sources[shape] = self.find_sources(len(args), tuple(kwargs))
            self._plans[shape] = _plan(*self._sources[shape])
        return bound.args, bound.kwargs

    def sources(self, shape: tuple[Any, ...]) -> Sources | None:
        """Where the bound arguments of calls of `shape` (the number of positional
        arguments, then the keyword names) come from, once such a call is bound."""
        return self._sources.get(shape)

    def find_sources(self, count: int, names: tuple[str, ...]) -> Sources:
        """Where the bound arguments of a call with `count` positional arguments
        and keyword arguments `names` come from (`TypeError` if none binds)."""
        assert self._signature is not None
        positional = [_Placeholder() for _ in range(count)]
        keyword = {name: _Placeholder() for name in names}
        bound = self._signature.bind(*positional, **keyword)
        bound.apply_defaults()
        found: dict[int, Source] = {
            id(p): ("args", i) for i, p in enumerate(positional)
        }
        found.update({id(p): ("kwargs", name) for name, p in keyword.items()})
        # A default: the very object that `apply_defaults` would pass.
        source = lambda value: found.get(id(value), ("default", value))  # noqa: E731
        return (
            [source(value) for value in bound.args],
            {name: source(value) for name, value in bound.kwargs.items()},
        )


def _plan(
    args: list[Source], kwargs: dict[str, Source]
) -> Callable[[Args, Kwargs], tuple[Args, Kwargs]]:
    """`plan(a, k)`: the bound arguments of a call `(*a, **k)`, from their sources."""
    namespace: dict[str, Any] = {}

    def constant(value: Any) -> str:
        name = f"c{len(namespace)}"
        namespace[name] = value
        return name

    def expression(source: Source) -> str:
        kind, value = source
        if kind == "args":
            return f"a[{value}]"
        if kind == "kwargs":
            return f"k[{constant(value)}]"
        return constant(value)

    positional = "".join(f"{expression(source)}, " for source in args)
    keyword = ", ".join(
        f"{constant(name)}: {expression(source)}" for name, source in kwargs.items()
    )
    body = [f"return ({positional}), {{{keyword}}}"]
    return compile_function("plan", "a, k", body, namespace)


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
        positional = [
            p
            for p in parameters
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if len(args) > len(positional):
            return (
                f"takes {len(positional)} positional argument"
                f"{'' if len(positional) == 1 else 's'} ({names}) but "
                f"{len(args)} were given."
            )
    return f"{error} (the parameters are ({names}))."
