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


class Binder:
    """`binder(args, kwargs)` gives `(args, kwargs)` as `inspect.Signature.bind`
    followed by `apply_defaults` would, so that `f(x)`, `f(x, 3)` and `f(x, n=3)`
    are one call.

    `Signature.bind` costs microseconds. For each shape of call (the number of
    positional arguments and the keyword names, in order) the binder binds
    placeholders once and records where each bound value comes from, as a
    generated function such as `lambda a, k: ((a[0], k['n']), {'mode': 'a'})`.
    """

    def __init__(self, signature: inspect.Signature | None, name: str):
        self._signature = signature
        self._name = name
        self._plans: dict[tuple[Any, ...], Callable[[Args, Kwargs], Any]] = {}

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
            self._plans[(len(args), *kwargs)] = self._plan(len(args), tuple(kwargs))
        return bound.args, bound.kwargs

    def _plan(
        self, count: int, names: tuple[str, ...]
    ) -> Callable[[Args, Kwargs], tuple[Args, Kwargs]]:
        assert self._signature is not None
        positional = [_Placeholder() for _ in range(count)]
        keyword = {name: _Placeholder() for name in names}
        bound = self._signature.bind(*positional, **keyword)
        bound.apply_defaults()
        sources = {id(p): f"a[{i}]" for i, p in enumerate(positional)}
        sources.update({id(p): f"k[name{i}]" for i, p in enumerate(keyword.values())})
        namespace: dict[str, Any] = {f"name{i}": name for i, name in enumerate(names)}

        def source(value: Any) -> str:
            if id(value) in sources:
                return sources[id(value)]
            # A default: the very object that `apply_defaults` would pass.
            constant = f"default{len(namespace)}"
            namespace[constant] = value
            return constant

        args = "".join(f"{source(value)}, " for value in bound.args)
        kwargs = []
        for i, (name, value) in enumerate(bound.kwargs.items()):
            namespace[f"key{i}"] = name
            kwargs.append(f"key{i}: {source(value)}")
        body = [f"return ({args}), {{{', '.join(kwargs)}}}"]
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
