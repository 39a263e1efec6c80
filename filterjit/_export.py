"""Exporting a filtered function: its array leaves as a `jax.export.Exported`, and
what `filter_jit` keeps static (the arguments' structure and static leaves, the
output's structure and static leaves) as data that loads without importing or
unpickling anything it names."""

import base64
import dataclasses
import inspect
import json
import struct
from collections.abc import Callable, Sequence
from typing import Any, Generic, ParamSpec, TypeVar

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.core import Tracer

from ._aot import Specialisation
from ._exact import exact_aux
from ._function import Function, signature_of
from ._jit import filter_jit, FilterJitWrapper
from ._leaves import is_array
from ._output import finish
from ._partition import static_key


_P = ParamSpec("_P")
_T = TypeVar("_T")

_MAGIC = b"filterjit.export\n"
_FORMAT_VERSION = 1


class _Traced:
    """Where a leaf is traced, in the templates of arguments and outputs."""

    def __repr__(self) -> str:
        return "<traced>"


_TRACED = _Traced()


class _Default:
    """A parameter left to its default, as the call binds it."""

    def __repr__(self) -> str:
        return "<default>"


_DEFAULT = _Default()

# -- Registration: the node types a payload may name, by the name it names them by.

_types_by_name: dict[str, type] = {}
_names_by_type: dict[type, str] = {}


def _is_namedtuple_type(kind: type) -> bool:
    return issubclass(kind, tuple) and hasattr(kind, "_fields")


def _fields_of(kind: type) -> list[str]:
    """The fields a node of a registrable type is saved and rebuilt by."""
    if _is_namedtuple_type(kind):
        return list(kind._fields)  # pyright: ignore[reportAttributeAccessIssue]
    return [field.name for field in dataclasses.fields(kind)]


def _default_name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def register_serializable(nodetype: type[_T], name: str | None = None) -> type[_T]:
    """Lets `filterjit.deserialize` rebuild arguments and outputs holding
    `nodetype`: an `eqx.Module` class, a dataclass or a namedtuple.

    A payload names the types in it; loading never imports them. The loading
    process registers each type it expects, once, before `filterjit.deserialize`.
    Saving needs no registration: a type is saved under its registered name, or
    else under `module.QualifiedName`, the name that registering it without `name`
    gives.

    **Arguments:**

    - `nodetype`: the class. An instance is rebuilt from its fields (dataclasses
        and Modules) or its items (namedtuples), without calling `__init__`, as
        `jax.tree_util` unflattens it.
    - `name`: the name to save and load it by; `module.QualifiedName` if omitted.

    **Returns:**

    `nodetype`, so that it may be used as a class decorator.

    !!! example

        ```python
        @filterjit.register_serializable
        class Linear(eqx.Module):
            weight: jax.Array
            activation: str = eqx.field(static=True)
        ```
    """
    if not isinstance(nodetype, type) or not (
        _is_namedtuple_type(nodetype) or dataclasses.is_dataclass(nodetype)
    ):
        raise TypeError(
            f"register_serializable takes an eqx.Module class, a dataclass or a "
            f"namedtuple class, not {nodetype!r}."
        )
    name = _default_name(nodetype) if name is None else name
    known = _types_by_name.get(name)
    if known is not None and known is not nodetype:
        raise ValueError(
            f"register_serializable: the name {name!r} is registered for {known!r} "
            f"already; register {nodetype!r} under another name (`name=`)."
        )
    _types_by_name[name] = nodetype
    _names_by_type[nodetype] = name
    return nodetype


# -- Saving a pytree, its traced leaves marked, as JSON, and loading it back.


class _Unsavable(TypeError):
    """A part of a pytree that cannot be saved: `where` it is, and what."""

    def __init__(self, where: str, what: str):
        super().__init__(where, what)
        self.where = where
        self.what = what


def _encode(value: Any, where: str, names: dict[str, type]) -> Any:
    """`value` (a prototype: `_TRACED` at traced leaves) as JSON data. `names`
    collects the node types it names."""
    kind = type(value)
    if value is _TRACED:
        return ["traced"]
    if value is None:
        return ["none"]
    if kind is bool:
        return ["bool", value]
    if kind is int:
        return ["int", str(value)]
    if kind is float:
        return ["float", value.hex()]
    if kind is complex:
        return ["complex", value.real.hex(), value.imag.hex()]
    if kind is str:
        return ["str", value]
    if kind is bytes:
        return ["bytes", base64.b64encode(value).decode("ascii")]
    if kind in (tuple, list, frozenset):
        items = sorted(value, key=repr) if kind is frozenset else value
        return [
            kind.__name__,
            [_encode(item, f"{where}[{i}]", names) for i, item in enumerate(items)],
        ]
    if kind is dict:
        return [
            "dict",
            [
                [
                    _encode(k, f"{where} (a key)", names),
                    _encode(v, f"{where}[{k!r}]", names),
                ]
                for k, v in value.items()
            ],
        ]
    if _is_namedtuple_type(kind) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type)
    ):
        name = _names_by_type.get(kind) or _default_name(kind)
        if names.setdefault(name, kind) is not kind:
            raise _Unsavable(where, f"a `{name}`, a name two types have here")
        fields = [(field, getattr(value, field)) for field in _fields_of(kind)]
        saved = [
            [field, _encode(item, f"{where}.{field}", names)] for field, item in fields
        ]
        return ["node", name, saved]
    raise _Unsavable(where, f"a `{kind.__qualname__}`")


def _unregistered(name: str) -> TypeError:
    short = name.rpartition(".")[2]
    return TypeError(
        f"filterjit.deserialize: the payload holds a `{name}`, a type that this "
        "process has not registered, so it is not loaded (loading never imports "
        "what a payload names). Import the class and register it under that "
        f"name first: `filterjit.register_serializable({short})` where it is "
        f"`{name}` here too, else `filterjit.register_serializable({short}, "
        f"name={name!r})`."
    )


def _decode(data: Any, resolve: Callable[[str], type]) -> Any:
    """The prototype that `_encode` saved, its node types found by `resolve`."""
    tag = data[0]
    if tag == "traced":
        return _TRACED
    if tag == "none":
        return None
    if tag == "bool":
        return bool(data[1])
    if tag == "int":
        return int(data[1])
    if tag == "float":
        return float.fromhex(data[1])
    if tag == "complex":
        return complex(float.fromhex(data[1]), float.fromhex(data[2]))
    if tag == "str":
        return str(data[1])
    if tag == "bytes":
        return base64.b64decode(data[1])
    if tag in ("tuple", "list", "frozenset"):
        items = [_decode(item, resolve) for item in data[1]]
        return {"tuple": tuple, "list": list, "frozenset": frozenset}[tag](items)
    if tag == "dict":
        return {_decode(k, resolve): _decode(v, resolve) for k, v in data[1]}
    if tag == "node":
        name, saved = data[1], data[2]
        kind = resolve(name)
        fields = [field for field, _ in saved]
        values = [_decode(item, resolve) for _, item in saved]
        expected = _fields_of(kind)
        if fields != expected:
            raise TypeError(
                f"filterjit.deserialize: the payload's `{name}` has the fields "
                f"{fields}, but the class registered under that name has {expected}. "
                "Load it with the version of the class it was saved with."
            )
        if _is_namedtuple_type(kind):
            return kind(*values)
        node = object.__new__(kind)  # as jax.tree_util unflattens a Module
        for field, item in zip(fields, values):
            object.__setattr__(node, field, item)
        return node
    raise ValueError(f"filterjit.deserialize: not a filterjit payload (tag {tag!r}).")


def _registered(name: str) -> type:
    kind = _types_by_name.get(name)
    if kind is None:
        raise _unregistered(name)
    return kind


# -- What is static: a tree's structure with its static leaves, traced leaves marked.


class _Template:
    """A pytree's structure, and its leaves: static values, `_TRACED` where traced."""

    def __init__(self, treedef: Any, leaves: list[Any], label: str):
        self.treedef = treedef
        self.leaves = leaves
        self.label = label
        self.exact = exact_aux(treedef)
        prototype = treedef.unflatten(leaves)
        paths = jtu.tree_flatten_with_path(prototype)[0]
        self.labels = [label + jtu.keystr(path) for path, _ in paths]
        self.traced = sum(leaf is _TRACED for leaf in leaves)

    @classmethod
    def of(cls, prototype: Any, label: str) -> "_Template":
        leaves, treedef = jtu.tree_flatten(prototype)
        return cls(treedef, leaves, label)

    def prototype(self) -> Any:
        return self.treedef.unflatten(self.leaves)

    def same_structure(self, treedef: Any) -> bool:
        return treedef == self.treedef and exact_aux(treedef) == self.exact

    def encode(self, fun_name: str, names: dict[str, type]) -> Any:
        """As JSON data; raises if a part cannot be saved, or is not rebuilt as it
        is (a pytree node whose structure does not come from its fields)."""
        prototype, label = self.prototype(), self.label
        try:
            data = _encode(prototype, label, names)
        except _Unsavable as e:
            raise TypeError(
                f"{fun_name}: cannot save `{e.where}`, {e.what}. A payload holds "
                "None, bools, ints, floats, complex numbers, strings and bytes, in "
                "tuples, lists, dicts, namedtuples, dataclasses and eqx.Modules. "
                "Make it part of the exported function (a Module field or a "
                "`functools.partial` argument), which is compiled in, or an array."
            ) from None
        rebuilt = _Template.of(_decode(data, names.__getitem__), label)
        if not self.same_structure(rebuilt.treedef):
            raise TypeError(
                f"{fun_name}: cannot save `{label}`: its structure {self.treedef} is "
                f"rebuilt from its types' fields as {rebuilt.treedef}. A payload "
                "saves namedtuples, dataclasses and eqx.Modules by their fields."
            )
        return data


def _same_static(now: Any, then: Any) -> bool:
    if type(now) is not type(then):
        return False
    try:
        return bool(static_key(now) == static_key(then))
    except Exception:  # an `==` that does not answer a bool: not the same
        return False


class _Difference:
    """Where two pytrees of different structures first differ: `static` if in a
    static value of one type (a static field), else in their structure."""

    def __init__(self, where: str, then: Any, now: Any, static: bool):
        self.where = where
        self.then = then
        self.now = now
        self.static = static


def _shape_of(node: Any) -> str:
    """A node as a structure error names it: its type, and its length or keys."""
    kind = type(node).__qualname__
    if type(node) is dict:
        return f"a dict with keys {sorted(map(repr, node))}"
    if type(node) in (tuple, list):
        return f"a {kind} of length {len(node)}"
    return "an array" if node is _TRACED else f"a `{kind}`"


def _difference(then: Any, now: Any, where: str) -> _Difference | None:
    """The first difference of a pytree `now` from the prototype `then`."""
    kind = type(then)
    if then is _TRACED:
        return None  # arrays are checked leaf by leaf
    if kind is not type(now):
        return _Difference(where, then, now, static=False)
    children: list[tuple[str, Any, Any]] = []
    if kind in (tuple, list) or _is_namedtuple_type(kind):
        if len(then) != len(now):
            return _Difference(where, then, now, static=False)
        steps = _fields_of(kind) if _is_namedtuple_type(kind) else None
        for i, (a, b) in enumerate(zip(then, now)):
            children.append((f".{steps[i]}" if steps else f"[{i}]", a, b))
    elif kind is dict:
        if list(then) != list(now):
            return _Difference(where, then, now, static=False)
        children = [(f"[{key!r}]", then[key], now[key]) for key in then]
    elif dataclasses.is_dataclass(then):
        children = [
            (f".{field}", getattr(then, field), getattr(now, field))
            for field in _fields_of(kind)
        ]
    elif not _same_static(now, then):
        return _Difference(where, then, now, static=True)
    for step, a, b in children:
        if (found := _difference(a, b, where + step)) is not None:
            return found
    return None


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
    default (whose value, where the export left it so, is the template's)."""

    def __init__(self, parameters: Sequence[tuple[str, int, bool]] | None):
        self.parameters = None if parameters is None else list(parameters)
        self._signature = None
        if parameters is not None:
            self._signature = inspect.Signature(
                [
                    inspect.Parameter(
                        name,
                        _KINDS[kind],
                        default=_DEFAULT if has_default else inspect.Parameter.empty,
                    )
                    for name, kind, has_default in parameters
                ]
            )

    @classmethod
    def of(cls, fun: Any) -> "_Parameters":
        signature = signature_of(fun, follow_wrapped=False)
        if signature is None:
            return cls(None)
        return cls(
            [
                (p.name, int(p.kind), p.default is not p.empty)
                for p in signature.parameters.values()
            ]
        )

    def bind(self, fun_name: str, args: Any, kwargs: Any) -> list[tuple[Any, Any]]:
        """The bound arguments, each as `(key, value)`: positional ones keyed by
        index, then keyword ones (sorted) by name; `_DEFAULT` for a default."""
        if self._signature is None:
            positional, keywords = list(args), dict(kwargs)
        else:
            try:
                bound = self._signature.bind(*args, **kwargs)
            except TypeError as e:
                raise TypeError(f"{fun_name}(): {e}.") from None
            bound.apply_defaults()
            positional, keywords = list(bound.args), bound.kwargs
        return [
            *enumerate(positional),
            *((name, keywords[name]) for name in sorted(keywords)),
        ]

    def name(self, key: Any) -> str:
        """How to name the argument bound at `key` to a user."""
        if isinstance(key, str) or self.parameters is None:
            return key if isinstance(key, str) else f"args[{key}]"
        kinds = (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        )
        positional = [name for name, kind, _ in self.parameters if kind in kinds]
        if key < len(positional):
            return positional[key]
        for name, kind, _ in self.parameters:
            if kind == inspect.Parameter.VAR_POSITIONAL:
                return f"{name}[{key - len(positional)}]"
        return f"args[{key}]"


class _Argument:
    """One bound argument: where it binds, whether the exporting call passed it
    (else left it to its default), and its template."""

    def __init__(self, key: Any, given: bool, template: _Template | None):
        self.key = key
        self.given = given
        # `None`: a default that could not be saved (so must be left as it is).
        self.template = template


# -- The exported object.


class Exported(Generic[_P, _T]):
    """A function exported by `filterjit.export`: called with the arguments of the
    function, it returns what `filter_jit(function)` returns; `serialize()` saves it
    and `filterjit.deserialize` loads it in another process."""

    def __init__(
        self,
        exported: Any,
        fun_name: str,
        parameters: _Parameters,
        arguments: list[_Argument],
        output: _Template,
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
        # `jax.export.Exported.call` traces its program anew on every call (about
        # 200 µs); under `jax.jit`, JAX's cache keeps one trace per set of avals.
        self._program = jax.jit(exported.call)
        avals = list(exported.in_avals)
        self._avals: dict[Any, list[Any]] = {}
        for argument in arguments:
            if argument.given and argument.template is not None:
                count = argument.template.traced
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

    def call(self, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Calls the exported function, as `filter_jit(function)(*args, **kwargs)`.

        Raises a `TypeError` naming the argument if its structure, or an array's
        shape or dtype, differs from the export's, and a `ValueError` naming it if a
        static value does.
        """
        inputs: list[Any] = []
        bound = self._parameters.bind(self.fun_name, args, kwargs)
        keys = [key for key, _ in bound]
        if keys != list(self._arguments):
            raise TypeError(
                f"{self.fun_name}: called with the arguments "
                f"({', '.join(map(self._parameters.name, keys))}), but exported for "
                f"({', '.join(map(self._parameters.name, self._arguments))}). Pass "
                "the arguments the export was made with, or export again."
            )
        for key, value in bound:
            inputs += self._check(self._arguments[key], value)
        outputs = iter(self._program(*inputs))
        leaves = [next(outputs) if x is _TRACED else x for x in self._output.leaves]
        return self._output.treedef.unflatten(leaves)

    def _check(self, argument: _Argument, value: Any) -> list[Any]:
        """The traced leaves of one argument of a call, checked against the export."""
        fun_name, name = self.fun_name, self._parameters.name(argument.key)
        template = argument.template
        if value is _DEFAULT:
            if argument.given:
                raise TypeError(
                    f"{fun_name}: argument `{name}` was passed when exported and "
                    "is left to its default now. Pass it, or export again."
                )
            return []
        if template is None:
            raise TypeError(
                f"{fun_name}: argument `{name}` was left to its default when "
                "exported (a default that could not be saved). Leave it so."
            )
        leaves, treedef = jtu.tree_flatten(value)
        if not template.same_structure(treedef):
            found = _difference(template.prototype(), value, name)
            if found is not None and found.static:  # a static field, compiled in
                raise ValueError(
                    f"{fun_name}: static argument `{found.where}` was "
                    f"{found.then!r} when exported and is {found.now!r} now. Static "
                    "values are compiled in: export again with the new value."
                )
            where = name if found is None else found.where
            differs = (
                ""
                if found is None
                else (
                    f" (`{where}` is {_shape_of(found.now)}, where the export has "
                    f"{_shape_of(found.then)})"
                )
            )
            raise TypeError(
                f"{fun_name}: argument `{name}` has another structure than the "
                f"export was made for{differs}. Pass an argument of that structure, "
                "or export again.\n  exported for: "
                f"{template.treedef}\n  called with:  {treedef}"
            )
        avals = iter(self._avals.get(argument.key, ()))
        traced = []
        for leaf, then, label in zip(leaves, template.leaves, template.labels):
            if then is _TRACED:
                if not (is_array(leaf) or isinstance(leaf, Tracer)):
                    raise TypeError(
                        f"{fun_name}: argument `{label}` was an array when exported "
                        f"and is {leaf!r} now (a `{type(leaf).__name__}`). Pass an "
                        "array, or export again."
                    )
                if not argument.given:
                    raise TypeError(
                        f"{fun_name}: argument `{label}` was left to its default "
                        "when exported, which is compiled in. Leave it so, or "
                        "export again passing it."
                    )
                _check_aval(fun_name, label, leaf, next(avals))
                traced.append(leaf)
            elif is_array(leaf) or isinstance(leaf, Tracer):
                raise TypeError(
                    f"{fun_name}: argument `{label}` was static ({then!r}) when "
                    "exported and is an array now. Pass the same value, or export "
                    "again."
                )
            elif not _same_static(leaf, then):
                raise ValueError(
                    f"{fun_name}: static argument `{label}` was {then!r} when "
                    f"exported and is {leaf!r} now. Static values are compiled in: "
                    "export again with the new value, or make it an array so that "
                    "it is traced."
                )
        return traced

    def serialize(self) -> bytes:
        """The export as bytes, for `filterjit.deserialize` in any process with the
        same versions of filterjit and JAX. Raises naming what cannot be saved."""
        names: dict[str, type] = {}
        arguments = []
        for argument in self._arguments.values():
            data = None
            if argument.template is not None:
                try:
                    data = argument.template.encode(self.fun_name, names)
                except TypeError:
                    if argument.given:
                        raise
            arguments.append(
                {"key": argument.key, "given": argument.given, "value": data}
            )
        header = {
            "format": _FORMAT_VERSION,
            "fun_name": self.fun_name,
            "parameters": self._parameters.parameters,
            "arguments": arguments,
            "output": self._output.encode(self.fun_name, names),
        }
        encoded = json.dumps(header).encode("utf-8")
        program = bytes(self.exported.serialize())
        return _MAGIC + struct.pack(">Q", len(encoded)) + encoded + program

    def __repr__(self) -> str:
        return f"<filterjit.Exported {self.fun_name} for {self.platforms}>"


def _check_aval(fun_name: str, label: str, leaf: Any, aval: Any) -> None:
    found = jax.typeof(leaf)
    shape, dtype = found.shape, found.dtype  # pyright: ignore[reportAttributeAccessIssue]
    fits = len(shape) == len(aval.shape) and all(
        not isinstance(expected, int) or size == expected
        for size, expected in zip(shape, aval.shape)
    )
    if fits and dtype == aval.dtype:
        return
    raise TypeError(
        f"{fun_name}: argument `{label}` is an array of {dtype}{list(shape)}, but the "
        f"export was made for {aval.str_short()}. Pass an array of that shape and "
        "dtype, or export again."
    )


def deserialize(data: bytes | bytearray) -> Exported[..., Any]:
    """Loads what `Exported.serialize()` saved.

    Nothing that the data names is imported or unpickled: the node types of the
    arguments and outputs (other than tuples, lists, dicts and `None`) must be
    registered in this process with `filterjit.register_serializable` first.

    **Arguments:**

    - `data`: the bytes `serialize()` returned.

    **Returns:**

    A `filterjit.Exported`, called with the arguments of the exported function.

    !!! example

        ```python
        exported = filterjit.deserialize(Path("model.bin").read_bytes())
        exported.call(x)
        ```
    """
    data = bytes(data)
    if not data.startswith(_MAGIC):
        raise ValueError(
            "filterjit.deserialize: these bytes were not made by "
            "`filterjit.Exported.serialize()`."
        )
    start = len(_MAGIC) + 8
    (length,) = struct.unpack(">Q", data[len(_MAGIC) : start])
    header = json.loads(data[start : start + length].decode("utf-8"))
    if header.get("format") != _FORMAT_VERSION:
        raise ValueError(
            f"filterjit.deserialize: a payload of format {header.get('format')!r}; "
            f"this version of filterjit reads format {_FORMAT_VERSION}."
        )
    fun_name = header["fun_name"]
    saved_parameters = header["parameters"]
    parameters = _Parameters(
        None
        if saved_parameters is None
        else [
            (str(name), int(kind), bool(default))
            for name, kind, default in saved_parameters
        ]
    )
    arguments = []
    for saved in header["arguments"]:
        key = saved["key"]
        value = saved["value"]
        template = None
        if value is not None:
            label = parameters.name(key)
            template = _Template.of(_decode(value, _registered), label)
        arguments.append(_Argument(key, saved["given"], template))
    output = _Template.of(_decode(header["output"], _registered), "output")
    exported = jax.export.deserialize(bytearray(data[start + length :]))
    return Exported(exported, fun_name, parameters, arguments, output)


# -- Exporting.


def export(
    fun: Callable[_P, _T], *, platforms: Sequence[str] | None = None
) -> Callable[..., Exported[_P, _T]]:
    """Exports a function for another process, as `jax.export.export(jax.jit(fun))`
    does, with `filter_jit`'s partition of the arguments.

    `export(fun)(*args, **kwargs)` takes the arguments of `fun`: array leaves may be
    arrays or `jax.ShapeDtypeStruct`s (with symbolic shapes from
    `jax.export.symbolic_shape`), and every other leaf is static, as `filter_jit`
    partitions them. The arrays of `fun` itself (an `eqx.Module`, a bound method's
    `self`, a `functools.partial`'s arguments) and of defaults the call leaves are
    compiled into the program, with its static leaves: a saved model carries its
    weights.

    **Arguments:**

    - `fun`: the function, or a `filter_jit` wrapper of it (whose options apply).
    - `platforms`: the platforms to lower for (`"cpu"`, `"cuda"`, `"rocm"`,
        `"tpu"`), as in `jax.export.export`; the default backend's if omitted.

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
    wrapper = fun if isinstance(fun, FilterJitWrapper) else filter_jit(fun)

    # Untyped: arrays may be given as `jax.ShapeDtypeStruct`s.
    def exporting(*args: Any, **kwargs: Any) -> Exported[_P, _T]:
        return _export(wrapper, platforms, args, kwargs)

    return exporting


def _leaf_count(tree: Any) -> int:
    return jtu.tree_structure(tree).num_leaves


def _bound_arguments(
    fun: Any,
    function: Function,
    parameters: _Parameters,
    called: Specialisation,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[list[_Argument], list[int]]:
    """Each bound argument of the exporting call with its template, and the
    positions (among the bound call's leaves) of the traced leaves of the arguments
    it passed: the program's inputs."""
    given = parameters.bind(function.name, args, kwargs)
    bound_args, bound_kwargs = function.bind(args, kwargs)
    values = [*bound_args, *(bound_kwargs[key] for key in sorted(bound_kwargs))]
    leaves, traced = called.leaves, set(called.partition.dynamic_positions)
    # The bound call's leaves: the function's own, then each argument's in turn.
    start = 0 if function.fun_is_leaf else _leaf_count(fun)
    arguments: list[_Argument] = []
    inputs: list[int] = []
    for (key, passed), value in zip(given, values, strict=True):
        span = range(start, start + _leaf_count(value))
        template_leaves = [_TRACED if p in traced else leaves[p] for p in span]
        template = _Template(
            jtu.tree_structure(value), template_leaves, parameters.name(key)
        )
        arguments.append(_Argument(key, passed is not _DEFAULT, template))
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


def _export(
    wrapper: FilterJitWrapper[..., Any],
    platforms: Sequence[str] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Exported[..., Any]:
    dispatcher, fun = wrapper._dispatcher, wrapper._fun
    function = dispatcher.function
    # The very partition and jitted function of a top-level call with these arrays.
    called = Specialisation(dispatcher, fun, *args, **kwargs)
    parameters = _Parameters.of(fun)
    arguments, inputs = _bound_arguments(
        fun, function, parameters, called, args, kwargs
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
        arrays = [is_array(x) or isinstance(x, Tracer) for x in out_leaves]
        template = [_TRACED if a else x for x, a in zip(out_leaves, arrays)]
        found.append(_Template(treedef, template, "output"))
        return [jnp.asarray(x) for x, a in zip(out_leaves, arrays) if a]

    program.__name__ = function.name.rpartition(".")[2]
    program.__qualname__ = function.name
    specs = [leaves[p] for p in inputs]
    exported = jax.export.export(jax.jit(program), platforms=platforms)(*specs)
    (output,) = found
    return Exported(exported, function.name, parameters, arguments, output)
