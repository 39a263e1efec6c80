"""The exported function's parameters, saved with the export: a call bound
to them in a process without the function, as `filter_jit` binds it."""

import inspect
from collections.abc import Sequence
from typing import Any

from .._binding import argument_label, Binder, BOUND
from .._function import call_signature, signature_of
from .._structure import PyTreeDef


class _Default:
    """A parameter left to its default, as the call binds it."""

    def __repr__(self) -> str:
        return "<default>"


DEFAULT = _Default()

KINDS = {
    int(kind): kind
    for kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.KEYWORD_ONLY,
        inspect.Parameter.VAR_KEYWORD,
    )
}


class Parameters:
    """The exported function's parameters: names, kinds and whether each has a
    default (whose value, where the export left it so, is the template's); a call
    bound to them by `Binder`, as `filter_jit` binds it, a default as `DEFAULT`."""

    def __init__(
        self,
        fun_name: str,
        parameters: Sequence[tuple[str, int, bool]] | None,
        aliases: Sequence[str] = (),
        bound: Sequence[str] = (),
    ):
        self.parameters = None if parameters is None else list(parameters)
        # Keywords a partial binds: not arguments unless a call passes them.
        self.bound = list(bound)
        # For a wrapper taking `*args` (`jax.vmap(f)`): the names of the positional
        # parameters of the function it wraps, to name its arguments by.
        self.aliases = list(aliases)
        signature = None
        if parameters is not None:
            signature = inspect.Signature(
                [
                    inspect.Parameter(
                        name,
                        KINDS[kind],
                        default=_default(name in bound, has_default),
                    )
                    for name, kind, has_default in parameters
                ]
            )
        self._signature = signature
        self._bind = Binder(signature, fun_name)

    @classmethod
    def of(cls, fun_name: str, fun: Any) -> "Parameters":
        signature = call_signature(fun)
        if signature is None:
            return cls(fun_name, None)
        parameters = signature.parameters.values()
        return cls(
            fun_name,
            [(p.name, int(p.kind), p.default is not p.empty) for p in parameters],
            _aliases(fun, signature),
            [p.name for p in parameters if p.default is BOUND],
        )

    def bind(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[tuple[int | str, Any]]:
        """The bound arguments, each as `(key, value)`: positional ones keyed by
        index, then keyword ones (sorted) by name; `DEFAULT` for a default."""
        positional, keywords = self._bind(args, kwargs)
        return [*enumerate(positional), *sorted(keywords.items())]

    def name(self, key: int | str) -> str:
        """How to name the argument bound at `key` to a user."""
        if isinstance(key, int) and 0 <= key < len(self.aliases):
            return self.aliases[key]
        signature = self._signature
        parameters = () if signature is None else signature.parameters.values()
        return argument_label(parameters, key)[1]


def _default(bound: bool, has_default: bool) -> Any:
    """A saved parameter's default: `BOUND` for what a partial binds (the call
    passes none), `DEFAULT` for a default, else none."""
    if bound:
        return BOUND
    return DEFAULT if has_default else inspect.Parameter.empty


def _aliases(fun: Any, signature: inspect.Signature) -> list[str]:
    """The positional parameters' names of the function that a wrapper taking only
    `*args` and `**kwargs` wraps (`jax.vmap(f)`, `functools.wraps`): names only, as
    the wrapper binds a call by its own signature."""
    kinds = [p.kind for p in signature.parameters.values()]
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    if not kinds or any(kind not in variadic for kind in kinds):
        return []
    wrapped = signature_of(fun, follow_wrapped=True)
    if wrapped is None:
        return []
    positional = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )
    return [p.name for p in wrapped.parameters.values() if p.kind in positional]


class Argument:
    """One bound argument: where it binds, whether the exporting call passed it
    (else left it to its default), its saved data (`None`: a default that could not
    be saved, so must be left as it is), and the labels of its traced leaves."""

    def __init__(self, key: int | str, given: bool, data: Any, labels: list[str]):
        self.key = key
        self.given = given
        self.data = data
        self.labels = labels
        # Where exported in this process: its structure, and the classes it names.
        self.treedef: PyTreeDef | None = None
        self.exact: Any = None
        self.classes: dict[str, type] = {}
