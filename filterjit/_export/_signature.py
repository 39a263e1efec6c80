"""The exported function's parameters, saved with the export: a call bound to them
by `filter_jit`'s `Binder`, and its arguments named as `filter_jit` names them, in
a process without the function."""

import inspect
from typing import Any

from .._binding import argument_label, Binder, BOUND
from .._function import call_signature, Function
from .._structure import PyTreeDef


class _Default:
    """A parameter left to its default, as the call binds it."""

    def __repr__(self) -> str:
        return "<default>"


DEFAULT = _Default()

KINDS = {int(kind): kind for kind in type(inspect.Parameter.POSITIONAL_ONLY)}
# A saved parameter's default: none, one (its value the template's), or what a
# partial binds (the call passes none).
DEFAULTS = {"none": inspect.Parameter.empty, "default": DEFAULT, "bound": BOUND}

Saved = list[list[Any]]  # `[name, kind, default]` a parameter, or `[name, kind]`


class Parameters:
    """The parameters a call binds to, `[name, kind, default]` each (`None`: bound
    as given), and those its arguments are named by, `[name, kind]` each (a
    wrapper's `*args` named by the function it wraps), as saved."""

    def __init__(self, fun_name: str, parameters: Saved | None, names: Saved):
        self.parameters = parameters
        self.names = names
        signature = None
        if parameters is not None:
            signature = inspect.Signature(
                [
                    inspect.Parameter(name, KINDS[kind], default=DEFAULTS[default])
                    for name, kind, default in parameters
                ]
            )
        self._bind = Binder(signature, fun_name)
        self._named = [inspect.Parameter(name, KINDS[kind]) for name, kind in names]

    @classmethod
    def of(cls, function: Function, fun: Any) -> "Parameters":
        signature = call_signature(fun)
        parameters = None
        if signature is not None:
            parameters = [
                [p.name, int(p.kind), _default_of(p)]
                for p in signature.parameters.values()
            ]
        names = [[p.name, int(p.kind)] for p in function.parameters]
        return cls(function.name, parameters, names)

    def bind(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[tuple[int | str, Any]]:
        """The bound arguments, each as `(key, value)`: positional ones keyed by
        index, then keyword ones (sorted) by name; `DEFAULT` for a default."""
        positional, keywords = self._bind(args, kwargs)
        return [*enumerate(positional), *sorted(keywords.items())]

    def name(self, key: int | str) -> str:
        """How to name the argument bound at `key` to a user."""
        return argument_label(self._named, key)[1]


def _default_of(parameter: inspect.Parameter) -> str:
    if parameter.default is BOUND:
        return "bound"
    return "none" if parameter.default is parameter.empty else "default"


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
