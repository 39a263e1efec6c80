"""The exported object: a call of it bound to the saved parameters by the core's
`Binder`, checked and run; its payload written; the output's template."""

import dataclasses
import inspect
from collections.abc import Iterator, Sequence
from typing import Any, Generic, ParamSpec, TypeVar

import jax
import jax.tree_util as jtu
from jax.core import ShapedArray

from .._binding import argument_label, Binder, BOUND
from .._exact import exact_aux
from .._function import call_signature, Function
from .._structure import PyTreeDef
from ._checks import (
    check_aval,
    check_sizes,
    Difference,
    difference,
    is_traced,
    shape_of,
)
from ._names import type_name
from ._payload import pack
from ._values import (
    decode,
    describe_value,
    encode,
    Encoding,
    Sentinel,
    SIZE,
    TRACED,
    Unsavable,
)


_P = ParamSpec("_P")
_T = TypeVar("_T")


# -- The parameters and arguments, as saved.

DEFAULT = Sentinel("<default>")
"""Where a call binds a parameter to its default."""
KINDS = {int(kind): kind for kind in type(inspect.Parameter.POSITIONAL_ONLY)}
# A saved parameter's default: none, one (its value the template's), or what a
# partial binds (the call passes none).
DEFAULTS = {"none": inspect.Parameter.empty, "default": DEFAULT, "bound": BOUND}
_DEFAULT_NAMES = {id(inspect.Parameter.empty): "none", id(BOUND): "bound"}  # by `is`

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
        # `(args, kwargs)` bound, `DEFAULT` for each parameter left to its default.
        self.bind = Binder(signature, fun_name)
        self._named = [inspect.Parameter(name, KINDS[kind]) for name, kind in names]

    @classmethod
    def of(cls, function: Function, fun: Any) -> "Parameters":
        signature = call_signature(fun)
        parameters = None
        if signature is not None:
            parameters = [
                [p.name, int(p.kind), _DEFAULT_NAMES.get(id(p.default), "default")]
                for p in signature.parameters.values()
            ]
        names = [[p.name, int(p.kind)] for p in function.parameters]
        return cls(function.name, parameters, names)

    def name(self, key: int | str) -> str:
        """How to name the argument bound at `key` to a user."""
        return argument_label(self._named, key)[1]


@dataclasses.dataclass
class Argument:
    """One bound argument: its key, whether the exporting call passed it, its saved
    data (`None`: a default that could not be saved) and its traced leaves' labels;
    whether the exporting call passed its parameter's default (static data equal to
    it), so that a call leaving it to its default is the same call; whether a
    `filterjit.jit` wrapper's option makes it static (held as it is, arrays
    included); where exported in this process, its structure and the classes it
    names."""

    key: int | str
    given: bool
    data: Any
    labels: list[str]
    default: bool = False
    static: bool = False  # made static by a `filterjit.jit` wrapper's option
    treedef: PyTreeDef | None = None
    exact: Any = None
    classes: dict[str, type] = dataclasses.field(default_factory=dict)
    opaque: int | None = None  # its first static that a payload cannot hold
    avals: list[ShapedArray] = dataclasses.field(default_factory=list)  # if given


# -- The output: its structure with its static leaves, traced leaves marked.


class Slot:
    """The place of a traced leaf in an output's data, in the order it is read."""

    def __init__(self, index: int):
        self.index = index


class Template:
    """A pytree with `TRACED` at traced leaves and `SIZE` at symbolic sizes; where
    loaded, `data`, its saved form, from which each output is built."""

    def __init__(self, prototype: Any, label: str, data: Any = None):
        paths, self.treedef = jtu.tree_flatten_with_path(prototype)
        self.leaves = [leaf for _, leaf in paths]
        self.labels = [label + jtu.keystr(path) for path, _ in paths]
        self.traced = sum(leaf is TRACED or leaf is SIZE for leaf in self.leaves)
        self.sizes = [i for i, leaf in enumerate(self.leaves) if leaf is SIZE]
        if data is not None:  # which traced leaf of the data each output fills
            numbered = decode(data, fill=lambda leaf, index: Slot(index))
            slots = [x for x in jtu.tree_leaves(numbered) if isinstance(x, Slot)]
            self.slots = [slot.index for slot in slots]
        self.exact = exact_aux(self.treedef)
        self.prototype, self.label, self.data = prototype, label, data

    def encode(self, fun_name: str) -> Any:
        """As JSON data; raises if a part cannot be saved, or is not rebuilt as it
        is (a pytree node whose structure does not come from its fields)."""
        if self.data is not None:
            return self.data
        encoding = Encoding()
        data = encoded(self.prototype, self.label, fun_name, encoding)
        _check_rebuilt(self, data, self.label, fun_name, encoding.names)
        return data

    def finish(self, outputs: Iterator[Any]) -> Any:
        """The output of a call, from the program's outputs (in the order its
        structure flattens, as the program returned them); where loaded, rebuilt
        from its data without running the classes' `__init__`."""
        if self.data is not None:
            by_slot: list[Any] = [None] * len(self.slots)
            for slot, value in zip(self.slots, outputs, strict=True):
                by_slot[slot] = value

            def fill(leaf: Sentinel, index: int) -> Any:
                value = by_slot[index]
                return int(value.shape[-1]) if leaf is SIZE else value

            return decode(self.data, fill=fill)
        leaves = [
            x if x is not TRACED and x is not SIZE else next(outputs)
            for x in self.leaves
        ]
        for position in self.sizes:  # an empty array whose last axis has that size
            leaves[position] = int(leaves[position].shape[-1])
        return self.treedef.unflatten(leaves)


_SAVES = (
    "A payload holds None, bools, ints, floats, complex numbers, strings and "
    "bytes, dtypes, registered enums and functions, JAX's and Equinox's own "
    "functions, in tuples, lists, dicts, namedtuples, dataclasses, eqx.Modules and "
    "eqx.nn.State. Make it part of the exported function (a Module field or a "
    "`functools.partial` argument), which is compiled in, or an array."
)


def encoded(value: Any, label: str, fun_name: str, encoding: Encoding) -> Any:
    try:
        return encode(value, label, encoding)
    except Unsavable as e:
        where, what = e.args
        raise TypeError(
            f"{fun_name}: cannot save `{where}`, {what}. {_SAVES}"
        ) from None


def _check_rebuilt(
    saved: "Argument | Template",
    data: Any,
    label: str,
    fun_name: str,
    classes: dict[str, type],
) -> None:
    """Raises unless `data`, rebuilt with the classes it names, has the structure of
    what was saved."""
    rebuilt = jtu.tree_structure(decode(data, classes))
    if rebuilt != saved.treedef or exact_aux(rebuilt) != saved.exact:
        raise TypeError(
            f"{fun_name}: cannot save `{label}`: its structure {saved.treedef} is "
            f"rebuilt from its types' fields as {rebuilt}. A payload saves "
            "namedtuples, dataclasses and eqx.Modules by their fields."
        )


# -- The exported object.


class Exported(Generic[_P, _T]):
    """A function exported by `filterjit.export`: called with the arguments of the
    function, it returns what `filter_jit(function)` returns; `serialize()` saves it
    and `filterjit.deserialize` loads it in another process."""

    def __init__(
        self,
        exported: jax.export.Exported,
        fun_name: str,
        parameters: Parameters,
        arguments: list[Argument],
        output: Template,
        donated: Sequence[int] = (),
        opaque: Sequence[tuple[str, Any]] = (),
    ):
        self.exported = exported
        """The `jax.export.Exported` of the array leaves: its inputs the traced
        leaves of the arguments (in the order `jax.tree_util` flattens the bound
        arguments), its outputs the traced leaves of the output."""
        self.fun_name = fun_name
        """The exported function's name."""
        self._parameters = parameters
        self._arguments = {argument.key: argument for argument in arguments}
        self._output = output
        self._donated = tuple(donated)
        # Statics of the arguments that a payload cannot hold: `(where, value)`.
        self._opaque = list(opaque)
        # `jax.export.Exported.call` traces its program anew on every call (about
        # 200 µs); under `jax.jit`, JAX's cache keeps one trace per set of avals.
        self._program = jax.jit(exported.call, donate_argnums=self._donated)
        avals = list(exported.in_avals)
        for argument in arguments:
            if argument.given:
                count = len(argument.labels)
                argument.avals, avals = avals[:count], avals[count:]
        if avals or len(exported.out_avals) != output.traced:
            raise ValueError(
                f"{fun_name}: an inconsistent export: its program takes or returns "
                "other arrays than its arguments and output hold."
            )

    @property
    def platforms(self) -> tuple[str, ...]:
        """The platforms the program was lowered for."""
        return tuple(self.exported.platforms)

    @property
    def nr_devices(self) -> int:
        """The number of devices the program was lowered for."""
        return int(self.exported.nr_devices)

    def mlir_module(self) -> str:
        """The program's StableHLO, as text (`jax.export.Exported.mlir_module`):
        its inputs are the arrays of `in_avals`, in that order."""
        return self.exported.mlir_module()

    @property
    def in_avals(self) -> dict[str, ShapedArray]:
        """The shape and dtype of each array the call takes, by the name of the
        argument it is (`"x"`, `"model.layers[0].weight"`), in the program's order."""
        named = [zip(a.labels, a.avals) for a in self._arguments.values()]
        return {label: aval for pairs in named for label, aval in pairs}

    @property
    def out_avals(self) -> dict[str, ShapedArray]:
        """The shape and dtype of each array the call returns, by its place in the
        output (`"output[0]"`); a symbolic size returned as a Python value is not an
        array, and is not named here."""
        output = self._output
        outputs = [
            (leaf, label)
            for leaf, label in zip(output.leaves, output.labels)
            if leaf is TRACED or leaf is SIZE
        ]
        return {
            label: aval
            for (leaf, label), aval in zip(outputs, self.exported.out_avals)
            if leaf is TRACED
        }

    def call(self, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Calls the exported function, as `filter_jit(function)(*args, **kwargs)`.

        Raises a `TypeError` naming the argument if its structure, or an array's
        shape or dtype, differs from the export's, and a `ValueError` naming it if a
        static value does.
        """
        inputs: list[Any] = []
        positional, keywords = self._parameters.bind(args, kwargs)
        bound = [*enumerate(positional), *sorted(keywords.items())]
        keys = [key for key, _ in bound]
        if keys != list(self._arguments):
            raise TypeError(
                f"{self.fun_name}: called with the arguments "
                f"({', '.join(map(self._parameters.name, keys))}), but exported for "
                f"({', '.join(map(self._parameters.name, self._arguments))}). Pass "
                "the arguments the export was made with, or export again."
            )
        sizes: list[tuple[str, int, Any]] = []
        for key, value in bound:
            inputs += self._check(self._arguments[key], value, sizes)
        check_sizes(self.fun_name, sizes)
        return self._output.finish(iter(self._program(*inputs)))

    def _check(
        self, argument: Argument, value: Any, sizes: list[tuple[str, int, Any]]
    ) -> list[Any]:
        """The traced leaves of one argument of a call, checked against the export.
        `sizes`: collects each symbolic dimension's place, size and expression."""
        fun_name, name = self.fun_name, self._parameters.name(argument.key)
        if value is DEFAULT:
            if argument.given and not argument.default:
                raise TypeError(
                    f"{fun_name}: argument `{name}` was passed when exported and "
                    "is left to its default now. Pass it, or export again."
                )
            return []
        if argument.data is None:
            raise TypeError(
                f"{fun_name}: argument `{name}` was left to its default when "
                "exported (a default that could not be saved). Leave it so."
            )
        opaque = [item for _, item in self._opaque]
        found = difference(argument.data, value, name, opaque)
        if argument.static:  # compiled in, as `jax.jit`'s static arguments are
            if found is not None:
                raise ValueError(
                    f"{fun_name}: static argument `{name}` was {found.then} when "
                    f"exported and is {describe_value(value)} now. Static values "
                    "are compiled in: export again with the new value."
                )
            return []
        if found is None and argument.treedef is not None:
            treedef = jtu.tree_structure(value)
            if treedef != argument.treedef or exact_aux(treedef) != argument.exact:
                found = Difference(name, "another structure", value, False)
        if found is not None and found.static:
            if found.then == "an array":
                raise TypeError(
                    f"{fun_name}: argument `{found.where}` was an array when "
                    f"exported and is {found.now!r} now (a "
                    f"`{type(found.now).__name__}`). Pass an array, or export again."
                )
            if is_traced(found.now):
                raise TypeError(
                    f"{fun_name}: argument `{found.where}` was static ({found.then}) "
                    "when exported and is an array now. Pass the same value, or "
                    "export again."
                )
            raise ValueError(
                f"{fun_name}: static argument `{found.where}` was {found.then} when "
                f"exported and is {describe_value(found.now)} now. Static values are "
                "compiled in: "
                "export again with the new value, or make it an array so that it "
                "is traced."
            )
        paths = jtu.tree_flatten_with_path(value)[0]
        traced = [(name + jtu.keystr(p), leaf) for p, leaf in paths if is_traced(leaf)]
        if found is not None or len(traced) != len(argument.labels):
            differs = ""
            advice = " Pass an argument of that structure, or export again."
            if found is not None:
                now = shape_of(found.now)
                if found.advice:
                    now, advice = f"a `{type_name(type(found.now))}`", found.advice
                differs = f" (`{found.where}` is {now}, where the export has "
                differs += f"{found.then})"
            raise TypeError(
                f"{fun_name}: argument `{name}` has another structure than the "
                f"export was made for{differs}.{advice}"
            )
        if traced and not argument.given:
            raise TypeError(
                f"{fun_name}: argument `{traced[0][0]}` was left to its default "
                "when exported, which is compiled in. Leave it so, or export again "
                "passing it."
            )
        for (label, leaf), aval in zip(traced, argument.avals):
            check_aval(fun_name, label, leaf, aval, sizes)
        return [leaf for _, leaf in traced]

    def serialize(self, *, vjp_order: int = 0) -> bytes:
        """The export as bytes, for `filterjit.deserialize` in any process with this
        version of filterjit and this or a newer JAX. Raises naming what cannot be
        saved.

        **Arguments:**

        - `vjp_order`: how many orders of derivatives the loaded export can take,
            as in `jax.export.Exported.serialize`: with `1`, `jax.grad` of the
            loaded `call` works. Each order saves another program.

        **Returns:**

        The payload: a header (format, filterjit's and JAX's versions, the
        arguments' and output's structures) and the program, with a checksum.
        """
        from .. import __version__  # set once the package has loaded

        arguments = []
        for argument in self._arguments.values():
            data, index = argument.data, argument.opaque
            if index is not None and argument.given:
                where, value = self._opaque[index]
                encoded(value, where, self.fun_name, Encoding())  # says why
                raise TypeError(
                    f"{self.fun_name}: cannot save `{where}`, a "
                    f"`{type(value).__qualname__}`. {_SAVES}"
                )
            if index is not None:
                data = None  # a default, left as it was: compiled in
            if (
                data is not None
                and argument.treedef is not None
                and not argument.static
            ):
                name = self._parameters.name(argument.key)
                _check_rebuilt(argument, data, name, self.fun_name, argument.classes)
            arguments.append(
                {
                    "key": argument.key,
                    "given": argument.given,
                    "value": data,
                    "labels": argument.labels,
                    "default": argument.default,
                    "static": argument.static,
                }
            )
        header = {
            "format": "filterjit.export",
            "filterjit": __version__,
            "jax": jax.__version__,
            "fun_name": self.fun_name,
            "parameters": self._parameters.parameters,
            "names": self._parameters.names,
            "arguments": arguments,
            "output": self._output.encode(self.fun_name),
            "donated": list(self._donated),
            "vjp_order": vjp_order,
        }
        program = bytes(self.exported.serialize(vjp_order=vjp_order))
        return pack(header, program)

    def __repr__(self) -> str:
        return f"<filterjit.Exported {self.fun_name} for {self.platforms}>"
