"""Static values as JSON data, and back: scalars and containers by value, classes by
their fields, dtypes and enums by name, functions by reference. Loading imports
nothing, unpickles nothing and calls no user `__init__`."""

import base64
import dataclasses
import enum
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._names import (
    allowed_name,
    by_name,
    fields_of,
    is_namedtuple_type,
    is_node_type,
    is_state_type,
    library_name,
    names_by_id,
    not_allowed,
    resolve_reference,
    state_type,
    type_name,
)
from ._payload import PayloadError


class Sentinel:
    def __init__(self, name: str):
        self._name = name

    def __repr__(self) -> str:
        return self._name


TRACED = Sentinel("<traced>")
"""Where a leaf is traced, in the templates of arguments and outputs."""
SIZE = Sentinel("<size>")
"""Where an output is a symbolic size, returned as the call's concrete size."""


class StaticArgument:
    """An argument a `filterjit.jit` wrapper makes static (`static_argnums`, any
    hashable type, a NumPy scalar included): held as it is, compared by type and
    value."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is StaticArgument
            and type(other.value) is type(self.value)
            and bool(other.value == self.value)
        )

    def __hash__(self) -> int:
        return hash((type(self.value), self.value))

    def __repr__(self) -> str:
        return repr(self.value)


# -- Encoding.


class Unsavable(TypeError):
    """A part of a pytree that cannot be saved: its `args`, where it is and what."""


class Encoding:
    """What an encoding collects: the classes it names, and where `opaque` is a list
    (an export in this process), the statics it cannot save, kept by index."""

    def __init__(self, opaque: list[tuple[str, Any]] | None = None):
        self.names: dict[str, type] = {}
        self.opaque = opaque


# A `None`, bool, int, float, complex, str or bytes as data, by its type.
_SCALAR_DATA: dict[type, Callable[[Any], list[Any]]] = {
    type(None): lambda _: ["none"],
    bool: lambda value: ["bool", value],
    int: lambda value: ["int", str(value)],
    float: lambda value: ["float", value.hex()],
    complex: lambda value: ["complex", value.real.hex(), value.imag.hex()],
    str: lambda value: ["str", value],
    bytes: lambda value: ["bytes", base64.b64encode(value).decode("ascii")],
}


def encode(value: Any, where: str, encoding: Encoding) -> Any:
    """`value` (a prototype: `TRACED` or `SIZE` at traced leaves) as JSON data."""
    kind = type(value)
    if value is TRACED:
        return ["traced"]
    if value is SIZE:
        return ["size"]
    if kind in _SCALAR_DATA:
        return _SCALAR_DATA[kind](value)
    if kind in (tuple, list, frozenset):
        items = sorted(value, key=repr) if kind is frozenset else value
        return [
            kind.__name__,
            [encode(item, f"{where}[{i}]", encoding) for i, item in enumerate(items)],
        ]
    if kind is dict:
        return [
            "dict",
            [
                [
                    encode(k, f"{where} (a key)", encoding),
                    encode(v, f"{where}[{k!r}]", encoding),
                ]
                for k, v in value.items()
            ],
        ]
    if kind is StaticArgument:
        return ["static", encode(value.value, where, encoding)]
    if issubclass(kind, np.generic) and np.dtype(kind).kind in "biufc":
        data = base64.b64encode(value.tobytes()).decode("ascii")
        return ["numpy", str(value.dtype), data]  # a static argument's, exactly
    if isinstance(value, np.dtype):
        return ["dtype", str(value)]
    if isinstance(value, type) and issubclass(value, np.generic):
        return ["scalar_type", str(np.dtype(value))]  # np.float32, ml_dtypes
    if issubclass(kind, enum.Enum) and id(kind) in names_by_id:
        encoding.names.setdefault(type_name(kind), kind)
        return ["enum", type_name(kind), value.name]
    if is_state_type(kind):
        children, keys = value.tree_flatten()
        return [
            "state",
            encode(keys, f"{where} (its keys)", encoding),
            [
                encode(child, f"{where}[{i}]", encoding)
                for i, child in enumerate(children)
            ],
        ]
    if is_namedtuple_type(kind) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type)
    ):
        return _encode_node(value, where, encoding)
    reference = names_by_id.get(id(value))
    name = reference[0] if reference is not None else library_name(value)
    if name is not None:
        return ["ref", name]
    if encoding.opaque is not None:
        encoding.opaque.append((where, value))
        return ["opaque", len(encoding.opaque) - 1]
    hint = ""
    if issubclass(kind, enum.Enum):
        hint = (
            " member, an enum not registered (register it with "
            f"`filterjit.register_serializable({kind.__qualname__})`)"
        )
    elif callable(value):
        hint = (
            " (a function is saved by reference where it is JAX's or Equinox's own, "
            "or registered with `filterjit.register_serializable`)"
        )
    raise Unsavable(where, f"a `{kind.__qualname__}`{hint}")


def _encode_node(value: Any, where: str, encoding: Encoding) -> Any:
    kind = type(value)
    name = type_name(kind)
    if encoding.names.setdefault(name, kind) is not kind:
        raise Unsavable(where, f"a `{name}`, a name two types have here")
    fields = [(field, getattr(value, field)) for field in fields_of(kind)]
    saved = [
        [field, encode(item, f"{where}.{field}", encoding)] for field, item in fields
    ]
    return ["node", name, saved]


# -- Decoding: what `encode` saved, every part checked.


class Malformed(ValueError):
    """Data that `encode` cannot have written."""


def need(condition: bool) -> None:
    if not condition:
        raise Malformed


MAX_NESTING = 200
"""How deeply a payload's values may nest (containers in containers)."""
MAX_COLLISIONS = 8
"""The most members of a saved frozenset (or keys of a dict) whose hashes may be
equal: more cannot have been saved, and would make building it quadratic."""
_NUMPY_SCALARS = frozenset(np.dtype(kind).name for kind in "?bhilqBHILQefdgFDG")
_INTEGER = re.compile(r"-?(0|[1-9][0-9]{0,4299})")  # as `str(int)` writes one
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


def _float(text: Any) -> float:
    need(isinstance(text, str) and len(text) < 64)
    try:
        return float.fromhex(text)
    except (ValueError, OverflowError):
        raise Malformed from None


def decode_scalar(data: Any) -> Any:
    """What `_SCALAR_DATA` saved."""
    tag = data[0]
    if tag == "none":
        need(len(data) == 1)
        return None
    if tag == "complex":
        need(len(data) == 3)
        return complex(_float(data[1]), _float(data[2]))
    need(len(data) == 2)
    if tag == "bool":
        need(type(data[1]) is bool)
        return data[1]
    if tag == "int":
        need(isinstance(data[1], str) and _INTEGER.fullmatch(data[1]) is not None)
        return int(data[1])
    if tag == "float":
        return _float(data[1])
    if tag == "str":
        need(isinstance(data[1], str))
        return data[1]
    if tag == "bytes":
        need(isinstance(data[1], str) and len(data[1]) % 4 == 0)
        need(_BASE64.fullmatch(data[1]) is not None)
        return base64.b64decode(data[1], validate=True)
    raise Malformed


SCALAR_TAGS = frozenset({"none", "bool", "int", "float", "complex", "str", "bytes"})


def unregistered(name: str) -> PayloadError:
    short = name.rpartition(".")[2]
    return PayloadError(
        "header",
        f"the payload returns a `{name}`, a type that this process has not "
        "registered, so it is not loaded (loading never imports what a payload "
        "names). Import the class and register it under that name first: "
        f"`filterjit.register_serializable({short})` where it is `{name}` here "
        f"too, else `filterjit.register_serializable({short}, name={name!r})`.",
    )


def decode(
    data: Any,
    classes: Mapping[str, Any] | None = None,
    fill: Callable[[Sentinel, int], Any] | None = None,
) -> Any:
    """The prototype that `encode` saved (`TRACED` or `SIZE` at traced leaves), its
    classes found in `classes` (else those registered), built without `__init__`;
    with `fill`, the `i`-th traced leaf read is `fill(leaf, i)`. Raises `Malformed`
    for data `encode` cannot have written, and `PayloadError` for a class or
    function this process cannot give it. Check `data` first (`check`): this
    builds its frozensets and dicts."""
    return _Decoder(by_name if classes is None else classes, fill).decode(data, 0)


def check(data: Any) -> int:
    """Raises `Malformed` unless `data` is what `encode` writes, building nothing
    hashable (no frozenset, dict or instance): members of a frozenset and keys of a
    dict are told apart by their saved data. Returns how many traced leaves (and
    symbolic sizes) it marks."""
    decoder = _Decoder({}, None, build=False)
    decoder.decode(data, 0)
    return decoder.marked


def _distinct(items: list[Any]) -> None:
    """Raises `Malformed` unless the saved data `items` are distinct (told apart by
    their JSON text, whose hash Python randomizes)."""
    texts = {json.dumps(item) for item in items}
    need(len(texts) == len(items))


def _spread(values: list[Any]) -> list[Any]:
    """`values`, raising `Malformed` unless each is hashable and no more than
    `MAX_COLLISIONS` of them share a hash: what a frozenset or dict of them costs
    to build is then linear."""
    try:
        hashes = sorted(hash(value) for value in values)
    except TypeError:
        raise Malformed from None
    run = 1
    for before, after in zip(hashes, hashes[1:]):
        run = run + 1 if before == after else 1
        need(run <= MAX_COLLISIONS)
    return values


class _Decoder:
    def __init__(
        self,
        classes: Mapping[str, Any],
        fill: Callable[[Sentinel, int], Any] | None,
        build: bool = True,
    ):
        self.classes = classes
        self.fill = fill
        self.build = build  # else only check: classes, enums and names unresolved
        self.marked = 0  # the traced leaves and sizes read

    def decode(self, data: Any, depth: int) -> Any:
        need(isinstance(data, list) and len(data) >= 1 and depth < MAX_NESTING)
        need(isinstance(data[0], str))
        depth += 1
        tag = data[0]
        if tag in ("traced", "size"):
            need(len(data) == 1)
            leaf = TRACED if tag == "traced" else SIZE
            self.marked += 1
            return leaf if self.fill is None else self.fill(leaf, self.marked - 1)
        if tag in SCALAR_TAGS:
            return decode_scalar(data)
        if tag in ("tuple", "list", "frozenset"):
            need(len(data) == 2 and isinstance(data[1], list))
            if tag == "frozenset":
                _distinct(data[1])
            items = [self.decode(item, depth) for item in data[1]]
            if not self.build:
                return None
            if tag == "frozenset":
                members = frozenset(_spread(items))
                need(len(members) == len(items))
                return members
            return tuple(items) if tag == "tuple" else items
        if tag == "dict":
            need(len(data) == 2 and isinstance(data[1], list))
            for pair in data[1]:
                need(isinstance(pair, list) and len(pair) == 2)
            _distinct([key for key, _ in data[1]])
            keys = [self.decode(key, depth) for key, _ in data[1]]
            values = [self.decode(value, depth) for _, value in data[1]]
            if not self.build:
                return None
            built = dict(zip(_spread(keys), values))
            need(len(built) == len(keys))
            return built
        if tag in ("static", "numpy"):  # an argument's alone, never built
            need(not self.build)
            if tag == "static":
                need(len(data) == 2)
                return self.decode(data[1], depth)
            need(len(data) == 3 and isinstance(data[2], str))
            need(isinstance(data[1], str) and data[1] in _NUMPY_SCALARS)
            need(len(data[2]) == 4 * -(-np.dtype(data[1]).itemsize // 3))
            need(_BASE64.fullmatch(data[2]) is not None)
            return None
        if tag in ("dtype", "scalar_type"):
            need(len(data) == 2 and isinstance(data[1], str) and len(data[1]) < 40)
            need(data[1].isidentifier())
            try:
                dtype = jnp.dtype(data[1])
            except TypeError:
                raise Malformed from None
            need(str(dtype) == data[1])
            return dtype if tag == "dtype" else dtype.type
        if tag == "enum":
            need(len(data) == 3 and isinstance(data[1], str))
            need(isinstance(data[2], str))
            if not self.build:
                return None
            kind = self.classes.get(data[1])
            if kind is None:
                raise unregistered(data[1])
            need(isinstance(kind, type) and issubclass(kind, enum.Enum))
            need(data[2] in kind.__members__)
            return kind.__members__[data[2]]
        if tag == "ref":
            need(len(data) == 2 and isinstance(data[1], str))
            name = data[1]
            if ":" in name and name not in by_name and not allowed_name(name):
                raise not_allowed(name)
            if not self.build:
                return None
            found = resolve_reference(name)
            if found is None:
                raise PayloadError(
                    "header",
                    f"the payload returns `{name}`, which is neither a JAX or "
                    "Equinox function of a module already imported here nor "
                    "registered (loading never imports what a payload names). "
                    "Import that module, or register the function with "
                    f"`filterjit.register_serializable(f, name={name!r})`.",
                )
            return found
        if tag == "state":
            return self._state(data, depth)
        if tag == "node":
            return self._node(data, depth)
        raise Malformed

    def _state(self, data: Any, depth: int) -> Any:
        need(len(data) == 3 and isinstance(data[2], list))
        keys = data[1]
        need(isinstance(keys, list) and len(keys) == 2 and keys[0] == "tuple")
        need(isinstance(keys[1], list) and len(keys[1]) == len(data[2]))
        need(all(isinstance(k, list) and k[:1] in (["str"], ["int"]) for k in keys[1]))
        _distinct(keys[1])
        built_keys = self.decode(keys, depth)
        values = [self.decode(child, depth) for child in data[2]]
        if not self.build:
            return None
        kind = state_type()
        if kind is None:
            raise PayloadError(
                "header",
                "the payload returns an `eqx.nn.State`: import equinox before "
                "loading it (loading never imports it).",
            )
        _spread(list(built_keys))
        return kind.tree_unflatten(built_keys, values)

    def _node(self, data: Any, depth: int) -> Any:
        need(len(data) == 3 and isinstance(data[1], str))
        need(isinstance(data[2], list))
        name, saved = data[1], data[2]
        for pair in saved:
            need(isinstance(pair, list) and len(pair) == 2)
            need(isinstance(pair[0], str))
        _distinct([field for field, _ in saved])
        if not self.build:
            for _, item in saved:
                self.decode(item, depth)
            return None
        kind = self.classes.get(name)
        if kind is None:
            raise unregistered(name)
        need(isinstance(kind, type) and is_node_type(kind))
        fields = [field for field, _ in saved]
        expected = fields_of(kind)
        if fields != expected:
            raise PayloadError(
                "header",
                f"the payload's `{name}` has the fields {fields}, but the class "
                f"registered under that name has {expected}. Load it with the "
                "version of the class it was saved with.",
            )
        values = [self.decode(item, depth) for _, item in saved]
        if is_namedtuple_type(kind):
            return tuple.__new__(kind, values)
        node = object.__new__(kind)  # as jax.tree_util unflattens a Module
        for field, item in zip(fields, values):
            object.__setattr__(node, field, item)  # no __init__, no __post_init__
        return node


def describe(data: Any) -> str:
    """A saved value as an error names it."""
    tag = data[0]
    if tag in SCALAR_TAGS:
        return repr(decode_scalar(data))
    if tag == "traced":
        return "an array"
    if tag == "dict":
        return f"a dict with keys {sorted(describe(k) for k, _ in data[1])}"
    if tag in ("tuple", "list"):
        return f"a {tag} of length {len(data[1])}"
    if tag == "node":
        return f"a `{data[1].rpartition('.')[2]}`"
    if tag == "ref":
        return data[1].replace(":", ".")
    if tag == "static":
        return describe(data[1])
    if tag == "numpy":
        value = np.frombuffer(base64.b64decode(data[2]), dtype=data[1])[0]
        return f"np.{data[1]}({value!r})"
    if tag == "dtype":
        return f"dtype({data[1]!r})"
    if tag == "scalar_type":
        return f"the scalar type {data[1]}"
    if tag == "enum":
        return f"{data[1].rpartition('.')[2]}.{data[2]}"
    return f"a saved {tag}"


def describe_value(value: Any) -> str:
    """A value as an error names it: a function of JAX or Equinox by its name."""
    found = names_by_id.get(id(value))
    name = found[0] if found is not None else None
    if name is None and callable(value) and not isinstance(value, type):
        name = library_name(value)
    return repr(value) if name is None else name.replace(":", ".")
