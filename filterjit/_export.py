"""Exporting a filtered function: its array leaves as a `jax.export.Exported`, and
what `filter_jit` keeps static (the arguments' structure and static leaves, the
output's structure and static leaves) as data that loads without importing or
unpickling anything it names."""

import ast
import contextlib
import dataclasses
import inspect
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, ParamSpec, TypeVar

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.core import ShapedArray, Tracer

from ._aot import Specialisation
from ._binding import argument_label, Binder, BOUND
from ._exact import exact_aux
from ._export_payload import pack, PayloadError, unpack
from ._export_values import (
    check,
    decode,
    describe,
    describe_value,
    encode,
    Encoding,
    fields_of,
    is_named,
    is_namedtuple_type,
    is_state_type,
    Malformed,
    resolve_reference,
    SCALAR_TAGS,
    SIZE,
    TRACED,
    type_name,
    Unsavable,
)
from ._function import call_signature, Function, signature_of
from ._jax_jit import JitWrapper
from ._jit import filter_jit, FilterJitWrapper
from ._leaves import is_array
from ._options import make_options
from ._output import finish
from ._partition import static_key
from ._structure import PyTreeDef
from ._trace import custom_call_targets, STABLE_TARGETS


_P = ParamSpec("_P")
_T = TypeVar("_T")


class _Default:
    """A parameter left to its default, as the call binds it."""

    def __repr__(self) -> str:
        return "<default>"


_DEFAULT = _Default()


def _is_traced(leaf: Any) -> bool:
    return is_array(leaf) or isinstance(leaf, Tracer)


# -- The output: its structure with its static leaves, traced leaves marked.


class _Template:
    """A pytree's structure, and its leaves: static values, `TRACED` where traced,
    `SIZE` where a symbolic size is (returned as the call's concrete size)."""

    def __init__(
        self, treedef: PyTreeDef, leaves: list[Any], label: str, data: Any = None
    ):
        self.treedef = treedef
        self.leaves = leaves
        self.label = label
        self.exact = exact_aux(treedef)
        # Loaded: the saved data, from which each output is built (no `__init__`).
        self.data = data
        paths = jtu.tree_flatten_with_path(self.prototype())[0]
        self.labels = [label + jtu.keystr(path) for path, _ in paths]
        self.traced = sum(leaf is TRACED or leaf is SIZE for leaf in leaves)

    @classmethod
    def loaded(cls, data: Any, label: str) -> "_Template":
        """The template of saved data, its classes registered in this process."""
        leaves, treedef = jtu.tree_flatten(decode(data))
        return cls(treedef, leaves, label, data)

    def prototype(self) -> Any:
        if self.data is not None:
            return decode(self.data)
        return self.treedef.unflatten(self.leaves)

    def encode(self, fun_name: str) -> Any:
        """As JSON data; raises if a part cannot be saved, or is not rebuilt as it
        is (a pytree node whose structure does not come from its fields)."""
        if self.data is not None:
            return self.data
        encoding = Encoding()
        data = _encoded(self.prototype(), self.label, fun_name, encoding)
        _check_rebuilt(
            self.treedef, self.exact, data, self.label, fun_name, encoding.names
        )
        return data

    def finish(self, outputs: Iterator[Any]) -> Any:
        """The output of a call, from the program's outputs."""

        def fill(leaf: Any) -> Any:
            if leaf is SIZE:  # an empty array whose last axis has that size
                return int(next(outputs).shape[-1])
            return next(outputs)

        if self.data is not None:
            return decode(self.data, fill=fill)
        leaves = [
            x if x is not TRACED and x is not SIZE else fill(x) for x in self.leaves
        ]
        return self.treedef.unflatten(leaves)


_SAVES = (
    "A payload holds None, bools, ints, floats, complex numbers, strings and "
    "bytes, dtypes, registered enums and functions, JAX's and Equinox's own "
    "functions, in tuples, lists, dicts, namedtuples, dataclasses, eqx.Modules and "
    "eqx.nn.State. Make it part of the exported function (a Module field or a "
    "`functools.partial` argument), which is compiled in, or an array."
)


def _encoded(value: Any, label: str, fun_name: str, encoding: Encoding) -> Any:
    try:
        return encode(value, label, encoding)
    except Unsavable as e:
        raise TypeError(
            f"{fun_name}: cannot save `{e.where}`, {e.what}. {_SAVES}"
        ) from None


def _check_rebuilt(
    treedef: PyTreeDef,
    exact: Any,
    data: Any,
    label: str,
    fun_name: str,
    classes: dict[str, type],
) -> None:
    """Raises unless `data`, rebuilt with the classes it names, has `treedef`."""
    rebuilt = jtu.tree_structure(decode(data, classes))
    if rebuilt != treedef or exact_aux(rebuilt) != exact:
        raise TypeError(
            f"{fun_name}: cannot save `{label}`: its structure {treedef} is "
            f"rebuilt from its types' fields as {rebuilt}. A payload saves "
            "namedtuples, dataclasses and eqx.Modules by their fields."
        )


# -- An argument: checked against its saved data, which names classes, not holds them.


class _Difference:
    """Where an argument first differs from what the export saved: `static` if in a
    static value, else in its structure."""

    def __init__(self, where: str, then: str, now: Any, static: bool, advice: str = ""):
        self.where = where
        self.then = then  # as an error names it
        self.now = now
        self.static = static
        self.advice = advice  # a sentence on how to fix it, if there is one


def _shape_of(node: Any) -> str:
    """A node as a structure error names it: its type, and its length or keys."""
    kind = type(node).__qualname__
    if type(node) is dict:
        return f"a dict with keys {sorted(map(repr, node))}"
    if type(node) in (tuple, list):
        return f"a {kind} of length {len(node)}"
    return "an array" if _is_traced(node) else f"a `{kind}`"


def _is_leaf(value: Any) -> bool:
    return value is not None and jtu.treedef_is_leaf(jtu.tree_structure(value))


def _static_data(value: Any) -> Any:
    try:
        return encode(value, "", Encoding())
    except Unsavable:
        return None


def _leaf_difference(
    then: Any, now: Any, where: str, opaque: Sequence[Any]
) -> _Difference | None:
    """The difference of a static leaf `now` from the saved leaf `then`."""
    tag = then[0]
    if tag == "opaque":
        same = _same_static(now, opaque[then[1]])
        return None if same else _Difference(where, repr(opaque[then[1]]), now, True)
    if tag == "ref":
        if resolve_reference(then[1]) is now:
            return None
    elif _static_data(now) == then:
        return None
    structure = not _is_leaf(now) and tag in SCALAR_TAGS and tag != "none"
    return _Difference(where, describe(then), now, not structure)


def _difference(
    then: Any, now: Any, where: str, opaque: Sequence[Any]
) -> _Difference | None:
    """The first difference of a value `now` from the saved data `then`."""
    tag = then[0]
    if tag == "traced" or _is_traced(now):
        if tag == "traced" and _is_traced(now):
            return None  # arrays are checked leaf by leaf
        leaf_then = tag not in ("tuple", "list", "dict", "node", "state")
        static = _is_leaf(now) if tag == "traced" else leaf_then
        return _Difference(where, describe(then), now, static)
    children: list[tuple[str, Any, Any]] = []
    if tag in ("tuple", "list"):
        if type(now) is not {"tuple": tuple, "list": list}[tag] or len(now) != len(
            then[1]
        ):
            return _Difference(where, describe(then), now, False)
        children = [(f"[{i}]", a, b) for i, (a, b) in enumerate(zip(then[1], now))]
    elif tag == "dict":
        if type(now) is not dict:
            return _Difference(where, describe(then), now, False)
        saved = {json.dumps(k): (k, v) for k, v in then[1]}
        found = {json.dumps(_static_data(k)): k for k in now}
        if set(saved) != set(found):
            return _Difference(where, describe(then), now, False)
        children = [
            (f"[{found[k]!r}]", saved[k][1], now[found[k]]) for k in sorted(saved)
        ]
    elif tag == "node":
        kind = type(now)
        is_node = is_namedtuple_type(kind) or (
            dataclasses.is_dataclass(now) and not isinstance(now, type)
        )
        fields = [field for field, _ in then[2]]
        if is_node and not is_named(kind, then[1]) and _short(kind) == _short(then[1]):
            return _other_module(where, then[1], now)
        if not is_node or not is_named(kind, then[1]) or fields_of(kind) != fields:
            return _Difference(where, describe(then), now, False)
        children = [(f".{f}", item, getattr(now, f)) for f, item in then[2]]
    elif tag == "state":
        if not is_state_type(type(now)):
            return _Difference(where, "an `eqx.nn.State`", now, False)
        values, keys = now.tree_flatten()
        if _static_data(keys) != then[1] or len(values) != len(then[2]):
            return _Difference(where, "another `eqx.nn.State`", now, False)
        children = [(f"[{i}]", a, b) for i, (a, b) in enumerate(zip(then[2], values))]
    else:
        return _leaf_difference(then, now, where, opaque)
    for step, a, b in children:
        if (found_difference := _difference(a, b, where + step, opaque)) is not None:
            return found_difference
    return None


def _short(kind: type | str) -> str:
    return (kind if isinstance(kind, str) else type_name(kind)).rpartition(".")[2]


def _other_module(where: str, saved: str, now: Any) -> _Difference:
    """A class of the saved class's name from another module (a class saved from
    a script, `__main__.Net`, called with `mypkg.Net`)."""
    name, short = type_name(type(now)), _short(saved)
    advice = (
        f" The export saved a `{saved}`, and `{where}` is a `{name}`: if they are "
        "one class, moved to another module, register it under the saved name "
        f"before calling: `filterjit.register_serializable({short}, "
        f"name={saved!r})`."
    )
    return _Difference(where, f"a `{saved}`", now, False, advice)


def _same_static(now: Any, then: Any) -> bool:
    if type(now) is not type(then):
        return False
    try:
        return bool(static_key(now) == static_key(then))
    except Exception:  # an `==` that does not answer a bool: not the same
        return False


# -- The call's parameters, to bind a call in a process without the function.


_KINDS = {
    int(kind): kind
    for kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.KEYWORD_ONLY,
        inspect.Parameter.VAR_KEYWORD,
    )
}


class _Parameters:
    """The exported function's parameters: names, kinds and whether each has a
    default (whose value, where the export left it so, is the template's); a call
    bound to them by `Binder`, as `filter_jit` binds it, a default as `_DEFAULT`."""

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
                        _KINDS[kind],
                        default=_default(name in bound, has_default),
                    )
                    for name, kind, has_default in parameters
                ]
            )
        self._signature = signature
        self._bind = Binder(signature, fun_name)

    @classmethod
    def of(cls, fun_name: str, fun: Any) -> "_Parameters":
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
        index, then keyword ones (sorted) by name; `_DEFAULT` for a default."""
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
    passes none), `_DEFAULT` for a default, else none."""
    if bound:
        return BOUND
    return _DEFAULT if has_default else inspect.Parameter.empty


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


class _Argument:
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


# -- The exported object.


class Exported(Generic[_P, _T]):
    """A function exported by `filterjit.export`: called with the arguments of the
    function, it returns what `filter_jit(function)` returns; `serialize()` saves it
    and `filterjit.deserialize` loads it in another process."""

    def __init__(
        self,
        exported: jax.export.Exported,
        fun_name: str,
        parameters: _Parameters,
        arguments: list[_Argument],
        output: _Template,
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
        self._avals: dict[int | str, list[ShapedArray]] = {}
        for argument in arguments:
            if argument.given:
                count = len(argument.labels)
                self._avals[argument.key], avals = avals[:count], avals[count:]
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
        found = {}
        for argument in self._arguments.values():
            if argument.given:
                found.update(zip(argument.labels, self._avals[argument.key]))
        return found

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
        bound = self._parameters.bind(args, kwargs)
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
        _check_sizes(self.fun_name, sizes)
        return self._output.finish(iter(self._program(*inputs)))

    def _check(
        self, argument: _Argument, value: Any, sizes: list[tuple[str, int, Any]]
    ) -> list[Any]:
        """The traced leaves of one argument of a call, checked against the export.
        `sizes`: collects each symbolic dimension's place, size and expression."""
        fun_name, name = self.fun_name, self._parameters.name(argument.key)
        if value is _DEFAULT:
            if argument.given:
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
        found = _difference(argument.data, value, name, opaque)
        if found is None and argument.treedef is not None:
            treedef = jtu.tree_structure(value)
            if treedef != argument.treedef or exact_aux(treedef) != argument.exact:
                found = _Difference(name, "another structure", value, False)
        if found is not None and found.static:
            if found.then == "an array":
                raise TypeError(
                    f"{fun_name}: argument `{found.where}` was an array when "
                    f"exported and is {found.now!r} now (a "
                    f"`{type(found.now).__name__}`). Pass an array, or export again."
                )
            if _is_traced(found.now):
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
        traced = [(name + jtu.keystr(p), leaf) for p, leaf in paths if _is_traced(leaf)]
        if found is not None or len(traced) != len(argument.labels):
            differs = ""
            advice = " Pass an argument of that structure, or export again."
            if found is not None:
                now = _shape_of(found.now)
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
        for (label, leaf), aval in zip(traced, self._avals.get(argument.key, ())):
            _check_aval(fun_name, label, leaf, aval, sizes)
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
        arguments = []
        for argument in self._arguments.values():
            data = argument.data
            index = None if data is None else _first_opaque(data)
            if index is not None and argument.given:
                where, value = self._opaque[index]
                _encoded(value, where, self.fun_name, Encoding())  # says why
                raise TypeError(
                    f"{self.fun_name}: cannot save `{where}`, a "
                    f"`{type(value).__qualname__}`. {_SAVES}"
                )
            if index is not None:
                data = None  # a default, left as it was: compiled in
            if data is not None and argument.treedef is not None:
                name = self._parameters.name(argument.key)
                _check_rebuilt(
                    argument.treedef,
                    argument.exact,
                    data,
                    name,
                    self.fun_name,
                    argument.classes,
                )
            arguments.append(
                {
                    "key": argument.key,
                    "given": argument.given,
                    "value": data,
                    "labels": argument.labels,
                }
            )
        header = {
            "format": "filterjit.export",
            "filterjit": _filterjit_version(),
            "jax": jax.__version__,
            "fun_name": self.fun_name,
            "parameters": self._parameters.parameters,
            "aliases": self._parameters.aliases,
            "bound": self._parameters.bound,
            "arguments": arguments,
            "output": self._output.encode(self.fun_name),
            "donated": list(self._donated),
            "vjp_order": vjp_order,
        }
        program = bytes(self.exported.serialize(vjp_order=vjp_order))
        return pack(header, program)

    def __repr__(self) -> str:
        return f"<filterjit.Exported {self.fun_name} for {self.platforms}>"


def _filterjit_version() -> str:
    from . import __version__  # set once the package has loaded

    return __version__


def _first_opaque(data: Any) -> int | None:
    """The index of the first static in `data` that a payload cannot hold."""
    if not isinstance(data, list) or not data:
        return None
    if data[0] == "opaque":
        return data[1]
    for item in data[1:]:
        if (found := _first_opaque(item)) is not None:
            return found
    return None


def _check_aval(
    fun_name: str,
    label: str,
    leaf: Any,
    aval: ShapedArray,
    sizes: list[tuple[str, int, Any]],
) -> None:
    found = jax.typeof(leaf)
    shape, dtype = found.shape, found.dtype  # pyright: ignore[reportAttributeAccessIssue]
    fits = len(shape) == len(aval.shape) and all(
        not isinstance(expected, int) or size == expected
        for size, expected in zip(shape, aval.shape)
    )
    if not fits or dtype != aval.dtype:
        raise TypeError(
            f"{fun_name}: argument `{label}` is an array of {dtype}{list(shape)}, but "
            f"the export was made for {aval.str_short()}. Pass an array of that "
            "shape and dtype, or export again."
        )
    for axis, (size, expected) in enumerate(zip(shape, aval.shape)):
        # A symbolic size (the loaded export exported again) is JAX's to check.
        if not isinstance(expected, int) and isinstance(size, int):
            sizes.append((f"{label}.shape[{axis}]", size, expected))


def _check_sizes(fun_name: str, sizes: list[tuple[str, int, Any]]) -> None:
    """Raises, naming the arguments, unless a call's sizes give each symbolic
    dimension one value: the dimensions' values are read where the export has a
    dimension alone (`b`), or solved where an expression holds one unknown
    (`2*b`); then every expression must give the size it stands for."""
    values: dict[str, tuple[int, str]] = {}  # each dimension's value, and where
    expressions: list[tuple[str, int, str, ast.expr]] = []
    for where, size, expected in sizes:
        text = str(expected)
        if text.isidentifier():
            first = values.setdefault(text, (size, where))
            if first[0] != size:
                raise TypeError(
                    f"{fun_name}: `{where}` is {size}, but `{first[1]}` is "
                    f"{first[0]}, and the export has `{text}` for both. Pass arrays "
                    "whose sizes agree."
                )
        else:
            expressions.append((where, size, text, _parsed(text)))
    for where, size, text, tree in expressions:
        unknown = sorted(_dimension_names(tree) - set(values))
        if len(unknown) == 1 and not _solve(tree, unknown[0], size, values, where):
            raise TypeError(
                f"{fun_name}: `{where}` is {size}, but the export has `{text}` "
                f"there, which is {size} for no size `{unknown[0]}` (an integer, at "
                "least 1). Pass arrays whose sizes agree."
            )
    for where, size, text, tree in expressions:
        env = {name: value for name, (value, _) in values.items()}
        if not _dimension_names(tree) <= set(env):
            continue  # dimensions no size determines: JAX's own check names them
        if _evaluate(tree, env) != size:
            given = ", ".join(
                f"`{name}` = {values[name][0]} (from `{values[name][1]}`)"
                for name in sorted(_dimension_names(tree))
            )
            raise TypeError(
                f"{fun_name}: `{where}` is {size}, but the export has `{text}` "
                f"there, which is {_evaluate(tree, env)} with {given}. Pass arrays "
                "whose sizes agree."
            )


_DIMENSION_FUNCTIONS: dict[str, Callable[..., int]] = {
    "floordiv": lambda a, b: a // b,
    "mod": lambda a, b: a % b,
    "max": max,
    "min": min,
    "non_negative": lambda a: max(a, 0),
}


def _parsed(text: str) -> ast.expr:
    # JAX writes a power `b^2`.
    return ast.parse(text.replace("^", "**"), mode="eval").body


def _dimension_names(tree: ast.expr) -> set[str]:
    return {
        node.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Name) and node.id not in _DIMENSION_FUNCTIONS
    }


def _evaluate(tree: ast.expr, env: dict[str, int]) -> int:
    """The value of a dimension expression as JAX writes it (`2*b + 1`,
    `floordiv(b, 2)`), its dimensions' values in `env`."""
    if isinstance(tree, ast.Constant) and type(tree.value) is int:
        return tree.value
    if isinstance(tree, ast.Name):
        return env[tree.id]
    if isinstance(tree, ast.UnaryOp) and isinstance(tree.op, ast.USub):
        return -_evaluate(tree.operand, env)
    if isinstance(tree, ast.BinOp):
        left, right = _evaluate(tree.left, env), _evaluate(tree.right, env)
        operations: dict[type, Callable[[int, int], int]] = {
            ast.Add: lambda a, b: a + b,
            ast.Sub: lambda a, b: a - b,
            ast.Mult: lambda a, b: a * b,
            ast.Pow: lambda a, b: a**b,
        }
        return operations[type(tree.op)](left, right)
    if isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name):
        function = _DIMENSION_FUNCTIONS[tree.func.id]
        return function(*(_evaluate(argument, env) for argument in tree.args))
    raise ValueError(f"not a dimension expression: {ast.unparse(tree)}")


def _solve(
    tree: ast.expr,
    name: str,
    size: int,
    values: dict[str, tuple[int, str]],
    where: str,
) -> bool:
    """Records the value of `name`, the one unknown of the expression at `where`,
    where the expression is linear in it (`2*b + 1`): `False` if no value gives
    `size`. Leaves another expression to JAX's check (`True`)."""
    env = {known: value for known, (value, _) in values.items()}
    try:
        at_0 = _evaluate(tree, {**env, name: 0})
        slope = _evaluate(tree, {**env, name: 1}) - at_0
        linear = _evaluate(tree, {**env, name: 2}) - at_0 == 2 * slope
    except (ValueError, KeyError, ZeroDivisionError):
        return True
    if slope == 0 or not linear:
        return True
    value = (size - at_0) // slope
    if (size - at_0) % slope != 0 or value < 1:
        return False
    if _evaluate(tree, {**env, name: value}) == size:
        values[name] = (value, where)
    return True


# -- Loading.


# Targets that hold an address in the process that made the program: never valid
# in a payload, whatever the export allowed.
_NEVER_ALLOWED = ("xla_python_", "xla_ffi_python_", "xla_ffi_partitioned_python_")
# How a serialized MLIR module in bytecode begins (MLIR's bytecode format).
_MLIR_BYTECODE = b"ML\xefR"


def _check_custom_calls(exported: jax.export.Exported, depth: int) -> None:
    """Raises for a custom call outside JAX's stable targets and those the export
    allowed, in the program and in its `depth` orders of derivatives."""
    allowed = set(STABLE_TARGETS)
    for disabled in exported.disabled_safety_checks:
        target = disabled.is_custom_call()
        if target is not None:
            allowed.add(target)
    for target in custom_call_targets(exported):
        if target.startswith(_NEVER_ALLOWED):
            raise PayloadError(
                "program",
                f"the payload's program calls `{target}`, a host callback of the "
                "process that made it, which no other process can run. It is "
                "refused: such a payload is corrupt or crafted.",
            )
        if target not in allowed and "ALL" not in allowed:
            raise PayloadError(
                "program",
                f"the payload's program calls the custom call `{target}`, which is "
                "not among the targets JAX guarantees stable, and the export did "
                "not allow it. Export with `disabled_checks=[jax.export."
                f"DisabledSafetyCheck.custom_call({target!r})]` if this process "
                "provides it.",
            )
    if depth > 0:
        _check_custom_calls(_vjp_of(exported), depth - 1)


def _vjp_of(exported: jax.export.Exported) -> jax.export.Exported:
    """The program's derivative, which the header says the payload holds."""
    if not exported.has_vjp():
        raise PayloadError(
            "program",
            "the payload's header says its program holds its derivative "
            "(`vjp_order`), and the program holds none (a corrupt or crafted "
            "payload). Save it again.",
        )
    return exported.vjp()


def _check_program(exported: jax.export.Exported, depth: int) -> None:
    """What can be checked of a program before JAX parses its StableHLO: the form
    of its module and the calling convention of its inputs, and of its `depth`
    orders of derivatives."""
    count = len(exported.in_avals)
    kept = exported.module_kept_var_idx
    if not exported.mlir_module_serialized.startswith(_MLIR_BYTECODE):
        raise PayloadError(
            "program",
            "the payload's program holds no StableHLO module in MLIR's bytecode "
            "(a corrupt or crafted payload). Save it again.",
        )
    if list(kept) != sorted(set(kept)) or not all(0 <= i < count for i in kept):
        raise PayloadError(
            "program",
            f"the payload's program keeps inputs {list(kept)} of {count}, which "
            "`jax.export` cannot have written (a corrupt or crafted payload).",
        )
    if exported.in_tree != jtu.tree_structure((tuple(range(count)), {})):
        raise PayloadError(
            "program",
            "the payload's program does not take its arrays as positional "
            "arguments, as an export of filterjit does (a corrupt or crafted "
            "payload).",
        )
    if depth > 0:
        _check_program(_vjp_of(exported), depth - 1)


@contextlib.contextmanager
def _jax_reading() -> Iterator[None]:
    """Where JAX reads the payload's program: what it raises for bytes it cannot
    read (`struct.error`, `IndexError`, its runtime's errors) refused as the
    payload's."""
    try:
        yield
    except PayloadError:
        raise
    except Exception as error:  # JAX's reader, never user code
        raise PayloadError(
            "program",
            "JAX cannot read the payload's program (a corrupt payload, or one of "
            f"an incompatible JAX): {type(error).__name__}. Export it again.",
        ) from None


def _malformed(part: str) -> PayloadError:
    return PayloadError(
        "header",
        f"the payload's header is not valid (a corrupt or crafted payload): {part} "
        "is not what `Exported.serialize()` writes. Save it again.",
    )


def deserialize(data: bytes | bytearray) -> Exported[..., Any]:
    """Loads what `Exported.serialize()` saved.

    Nothing that the data names is imported, unpickled or initialised: classes of
    static outputs must be registered in this process with
    `filterjit.register_serializable` first (arguments need no registration), and
    their instances are rebuilt without calling `__init__`. The payload's checksum,
    versions and structure are checked, functions it names must be among those a
    payload may name, and its program may call no custom call outside JAX's stable
    targets unless the export allowed it (`disabled_checks`).

    The checks find damage and refuse what `serialize()` cannot have written, but
    the program's StableHLO is read by JAX, whose reader can abort the process on
    some crafted bytes: load bytes from a source you do not trust in a separate
    process.

    **Arguments:**

    - `data`: the bytes `serialize()` returned.

    **Returns:**

    A `filterjit.Exported`, called with the arguments of the exported function.

    **Raises:**

    A `filterjit.PayloadError` (a `ValueError`) saying where and what is wrong for
    every payload it refuses: truncated, corrupt or crafted, of another format or
    of a newer JAX. A `TypeError` naming the class or function to register for a
    static output this process cannot rebuild.

    !!! example

        ```python
        exported = filterjit.deserialize(Path("model.bin").read_bytes())
        exported.call(x)
        ```
    """
    header, program = unpack(bytes(data))
    try:
        parts = _read_header(header)
    except PayloadError:
        raise
    except (Malformed, LookupError, TypeError, ValueError, RecursionError):
        raise _malformed("its function, parameters or arguments") from None
    fun_name, parameters, arguments, output_data, donated, vjp_order = parts
    try:
        output = _Template.loaded(output_data, "output")
    except (PayloadError, TypeError):
        raise  # a function it may not name; a class to register
    except (Malformed, LookupError, ValueError, RecursionError):
        raise _malformed("its output") from None
    with _jax_reading():  # its Python parts: the StableHLO is not parsed yet
        exported = jax.export.deserialize(bytearray(program))
        _check_program(exported, vjp_order)
    if len(set(donated)) != len(donated) or not all(
        0 <= i < len(exported.in_avals) for i in donated
    ):
        raise _malformed("its donated inputs")
    try:
        loaded = Exported(exported, fun_name, parameters, arguments, output, donated)
    except ValueError:
        raise PayloadError(
            "header",
            "the payload's header is not valid (a corrupt or crafted payload): its "
            "arguments and output hold other arrays than its program takes "
            f"({len(exported.in_avals)}) and returns ({len(exported.out_avals)}).",
        ) from None
    with _jax_reading():  # parses the StableHLO, and its derivatives'
        _check_custom_calls(exported, vjp_order)
    return loaded


def _read_header(
    header: dict[str, Any],
) -> tuple[str, _Parameters, list[_Argument], Any, list[int], int]:
    """The parts of a payload's header, each checked; raises if one is malformed."""
    if header["format"] != "filterjit.export":
        raise Malformed
    fun_name = header["fun_name"]
    saved_parameters = header["parameters"]
    if not isinstance(fun_name, str):
        raise Malformed
    aliases, bound = header["aliases"], header["bound"]
    for name in [*aliases, *bound]:
        if not (isinstance(name, str) and name.isidentifier()):
            raise Malformed
    parameters = _Parameters(
        fun_name,
        None
        if saved_parameters is None
        else [_parameter(*saved) for saved in saved_parameters],
        aliases,
        bound,
    )
    arguments = []
    for saved in header["arguments"]:
        key, given, value, labels = (
            saved["key"],
            saved["given"],
            saved["value"],
            saved["labels"],
        )
        if not (type(key) in (int, str) and type(given) is bool):
            raise Malformed
        if not (isinstance(labels, list) and all(isinstance(x, str) for x in labels)):
            raise Malformed
        if value is not None:
            check(value)
        arguments.append(_Argument(key, given, value, labels))
    donated, vjp_order = header["donated"], header["vjp_order"]
    if not (isinstance(donated, list) and all(type(i) is int for i in donated)):
        raise Malformed
    if type(vjp_order) is not int or not 0 <= vjp_order < 8:
        raise Malformed
    return fun_name, parameters, arguments, header["output"], donated, vjp_order


def _parameter(name: Any, kind: Any, default: Any) -> tuple[str, int, bool]:
    if not (isinstance(name, str) and name.isidentifier()):
        raise Malformed
    if type(kind) is not int or kind not in _KINDS or type(default) is not bool:
        raise Malformed
    return name, kind, default


# -- Exporting.


def export(
    fun: Callable[_P, _T],
    *,
    platforms: Sequence[str] | None = None,
    disabled_checks: Sequence[jax.export.DisabledSafetyCheck] = (),
) -> Callable[..., Exported[_P, _T]]:
    """Exports a function for another process, as `jax.export.export(jax.jit(fun))`
    does, with `filter_jit`'s partition of the arguments.

    `export(fun)(*args, **kwargs)` takes the arguments of `fun`: array leaves may be
    arrays or `jax.ShapeDtypeStruct`s (with symbolic shapes from
    `jax.export.symbolic_shape`), and every other leaf is static, as `filter_jit`
    partitions them. The arrays of `fun` itself (an `eqx.Module`, a bound method's
    `self`, a `functools.partial`'s arguments) and of defaults the call leaves are
    compiled into the program, with its static leaves: a saved model carries its
    weights. A symbolic size that `fun` returns as a Python value (`xs.shape[0]`)
    is returned by `call` as the call's concrete size, as `filter_jit` returns it.

    **Arguments:**

    - `fun`: the function, or a `filter_jit` wrapper of it (whose options apply:
        its donated arguments are donated by `Exported.call`, also once loaded).
    - `platforms`: the platforms to lower for (`"cpu"`, `"cuda"`, `"rocm"`,
        `"tpu"`), as in `jax.export.export`; the default backend's if omitted.
    - `disabled_checks`: as in `jax.export.export`: a
        `jax.export.DisabledSafetyCheck.custom_call(name)` lets the program call a
        custom call of your own (an FFI kernel) that JAX does not guarantee stable.
        `filterjit.deserialize` refuses any other.

    **Returns:**

    A function of the arguments of `fun` that returns a `filterjit.Exported`.

    !!! example

        ```python
        batch = jax.export.symbolic_shape("b")[0]
        x = jax.ShapeDtypeStruct((batch, 3), jnp.float32)
        exported = filterjit.export(model)(x)
        data = exported.serialize()  # filterjit.deserialize(data).call(x) elsewhere
        ```
    """
    if isinstance(fun, JitWrapper):
        wrapper = _as_filter_jit(fun)
    elif isinstance(fun, FilterJitWrapper):
        wrapper = fun
    else:
        wrapper = filter_jit(fun)
    checks = tuple(disabled_checks)

    # Untyped: arrays may be given as `jax.ShapeDtypeStruct`s.
    def exporting(*args: Any, **kwargs: Any) -> Exported[_P, _T]:
        return _export(wrapper, platforms, checks, args, kwargs)

    return exporting


def _as_filter_jit(wrapper: JitWrapper[..., Any]) -> FilterJitWrapper[..., Any]:
    """A `filterjit.jit` wrapper as `filter_jit` with its keywords, so that its
    export is the program `jax.export.export` makes of it: its donated arguments
    donated, its shardings kept, its other keywords passed on. Its static arguments
    are static as every leaf that is not an array is."""
    keywords = dict(wrapper._jit_kwargs)
    name = getattr(wrapper, "__qualname__", repr(wrapper))
    parameters = list(inspect.signature(wrapper).parameters.values())
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p.name for p in parameters if p.kind in kinds]

    def named(option: str) -> list[str]:
        """The parameters an `*_argnums` or `*_argnames` option names."""
        found = list(_as_tuple(keywords.pop(f"{option}_argnames", ())))
        for number in _as_tuple(keywords.pop(f"{option}_argnums", ())):
            if not -len(positional) <= number < len(positional):
                raise TypeError(
                    f"filterjit.export: {name} has {option}_argnums={number}, which "
                    "is not a parameter of its own (an argument that `*args` "
                    f"collects). Export a function that names it, or use "
                    f"`filterjit.filter_jit(f, donate=...)`."
                )
            found.append(positional[number])
        return found

    static = named("static")
    donated = named("donate")
    if isinstance(keywords.get("in_shardings"), tuple | list):
        # jax.jit's are the non-static arguments'; filter_jit's, every positional's.
        given = iter(keywords["in_shardings"])
        keywords["in_shardings"] = tuple(
            None if parameter in static else next(given, None)
            for parameter in positional
        )
    options = make_options(donate=tuple(donated) or "none", **keywords)
    return FilterJitWrapper(wrapper._function, options)


def _as_tuple(value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int | str) else tuple(value)


def _leaf_count(tree: Any) -> int:
    return jtu.tree_structure(tree).num_leaves


def _bound_arguments(
    fun: Any,
    function: Function,
    parameters: _Parameters,
    called: Specialisation,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    encoding: Encoding,
) -> tuple[list[_Argument], list[int]]:
    """Each bound argument of the exporting call with its saved data, and the
    positions (among the bound call's leaves) of the traced leaves of the arguments
    it passed: the program's inputs."""
    given = parameters.bind(args, kwargs)
    bound_args, bound_kwargs = function.bind(args, kwargs)
    values = [*bound_args, *(bound_kwargs[key] for key in sorted(bound_kwargs))]
    leaves, traced = called.leaves, set(called.partition.dynamic_positions)
    # The bound call's leaves: the function's own, then each argument's in turn.
    start = 0 if function.fun_is_leaf else _leaf_count(fun)
    arguments: list[_Argument] = []
    inputs: list[int] = []
    for (key, passed), value in zip(given, values, strict=True):
        span = range(start, start + _leaf_count(value))
        template_leaves = [TRACED if p in traced else leaves[p] for p in span]
        treedef, label = jtu.tree_structure(value), parameters.name(key)
        prototype = treedef.unflatten(template_leaves)
        data = _encoded(prototype, label, function.name, encoding)
        paths = jtu.tree_flatten_with_path(prototype)[0]
        labels = [label + jtu.keystr(p) for p, leaf in paths if leaf is TRACED]
        argument = _Argument(key, passed is not _DEFAULT, data, labels)
        argument.treedef, argument.exact = treedef, exact_aux(treedef)
        arguments.append(argument)
        if passed is not _DEFAULT:
            inputs += [p for p in span if p in traced]
        start = span.stop
    if start != len(leaves):
        raise AssertionError(
            f"{function.name}: the bound call has {len(leaves)} leaves"
        )
    return arguments, inputs


def _compiled_in(
    function: Function, called: Specialisation, inputs: list[int]
) -> dict[int, Any]:
    """The traced leaves that are not the program's inputs (the function's own, and
    defaults'), by position: compiled into the program."""
    treedef, leaves = called.partition.treedef, called.leaves
    labels = [p.label for p in function.leaf_parameters(treedef)]
    taken = set(inputs)
    found = {}
    for position in called.partition.dynamic_positions:
        if position in taken:
            continue
        if isinstance(leaves[position], jax.ShapeDtypeStruct):
            raise TypeError(
                f"{function.name}: `{labels[position]}` is a jax.ShapeDtypeStruct, "
                "but arrays of the function itself and of defaults are compiled "
                "into the export: give it a value."
            )
        found[position] = leaves[position]
    return found


def _donated_inputs(called: Specialisation, inputs: list[int]) -> list[int]:
    """Which of the program's inputs the wrapper donates, as JAX lowers its call."""
    lowered = called.jitted.lower(*called.dynamic)
    flags = [info.donated for info in jtu.tree_leaves(lowered.args_info)]
    positions = called.partition.dynamic_positions
    donated = {positions[i] for i, flag in enumerate(flags) if flag}
    return [i for i, position in enumerate(inputs) if position in donated]


def _output_leaf(leaf: Any) -> Any:
    """What the program returns for an output leaf: an array for a traced one, and
    for a symbolic size an empty array whose last axis has that size."""
    if _is_traced(leaf):
        return jnp.asarray(leaf)
    return jnp.zeros((0, leaf), jnp.int8)


def _is_symbolic(leaf: Any) -> bool:
    return not isinstance(leaf, int) and jax.export.is_symbolic_dim(leaf)


def _export(
    wrapper: FilterJitWrapper[..., Any],
    platforms: Sequence[str] | None,
    disabled_checks: Sequence[jax.export.DisabledSafetyCheck],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Exported[..., Any]:
    dispatcher, fun = wrapper._dispatcher, wrapper._fun
    function = dispatcher.function
    # The very partition and jitted function of a top-level call with these arrays.
    called = Specialisation(dispatcher, fun, *args, **kwargs)
    parameters = _Parameters.of(function.name, fun)
    encoding = Encoding(opaque=[])
    arguments, inputs = _bound_arguments(
        fun, function, parameters, called, args, kwargs, encoding
    )
    compiled_in = _compiled_in(function, called, inputs)
    positions, leaves, jitted = (
        called.partition.dynamic_positions,
        called.leaves,
        called.jitted,
    )
    found: list[_Template] = []  # what the one trace below learns of the output

    def program(*traced_inputs: Any) -> list[Any]:
        given_leaves = iter(traced_inputs)
        dynamic = [
            compiled_in[p] if p in compiled_in else next(given_leaves)
            for p in positions
        ]
        output = finish(jitted(*dynamic), leaves)
        out_leaves, treedef = jtu.tree_flatten(output)
        template = [
            TRACED if _is_traced(x) else SIZE if _is_symbolic(x) else x
            for x in out_leaves
        ]
        found.append(_Template(treedef, template, "output"))
        return [
            _output_leaf(x)
            for x, kind in zip(out_leaves, template)
            if kind is TRACED or kind is SIZE
        ]

    program.__name__ = function.name.rpartition(".")[2]
    program.__qualname__ = function.name
    specs = [leaves[p] for p in inputs]
    donated = [] if dispatcher.options.donate == "none" else None
    if donated is None:
        donated = _donated_inputs(called, inputs)
    exported = jax.export.export(
        jax.jit(program, donate_argnums=tuple(donated)),
        platforms=platforms,
        disabled_checks=disabled_checks,
    )(*specs)
    (output,) = found
    for argument in arguments:
        argument.classes = encoding.names
    return Exported(
        exported,
        function.name,
        parameters,
        arguments,
        output,
        donated,
        encoding.opaque or (),
    )
