"""A payload's program, checked before JAX reads it and against what JAX read: its
serialized form within fixed limits (its shapes' text, its derivatives, its
devices and calling convention), then its entry point (its inputs' and outputs'
types, what it donates) against what it and its header claim."""

import math
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .. import _private_jax as jax_private
from . import _dims as dims
from ._payload import PayloadError


MAX_DERIVATIVES = 7
"""The most orders of derivatives a payload's program may hold (`vjp_order`)."""
MAX_DEVICES = 1 << 16
"""The most devices a payload's program may be lowered for."""
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
"""The platforms a payload's program may be lowered for."""
_MAX_NAME = 1000  # the longest platform, target, effect or axis name
# How a serialized MLIR module in bytecode begins (MLIR's bytecode format).
MLIR_BYTECODE = b"ML\xefR"


def _refused(what: str) -> PayloadError:
    return PayloadError(
        "program",
        f"the payload's program is not what `jax.export` writes (a corrupt or "
        f"crafted payload): {what}. Export it again.",
    )


def _need(condition: bool, what: str) -> None:
    if not condition:
        raise _refused(what)


# -- Before JAX reads it: the serialized `jax.export.Exported`, a flatbuffer.


class _Reading:
    """What one read of a serialized program counts: the characters of shape text
    read, which may not exceed the program's length (each is stored once)."""

    def __init__(self, data: bytes):
        self.size = len(data)
        self.text = 0

    def count(self, length: int, width: int, what: str) -> int:
        """A vector's `length` of `width`-byte items, checked to fit the data."""
        _need(0 <= length * width <= self.size, f"{what} is longer than the payload")
        return length

    def string(self, raw: bytes | None, what: str) -> str:
        _need(raw is not None and len(raw) <= _MAX_NAME, f"{what} is too long")
        assert raw is not None
        return raw.decode("utf-8")

    def shape(self, aval: Any) -> None:
        for axis in range(self.count(aval.ShapeLength(), 4, "a shape")):
            text = aval.Shape(axis)
            self.text += len(text)
            _need(self.text <= self.size, "its shapes' text is longer than it")
            try:
                dims.parse(text.decode("utf-8"))
            except (dims.DimensionError, UnicodeDecodeError) as error:
                raise _refused(f"a dimension {text[:80]!r}: {error}") from None


def check_serialized(data: bytes, vjp_order: int) -> None:
    """Raises `PayloadError` unless `data`, a serialized `jax.export.Exported`, holds
    what `jax.export` writes within filterjit's limits, before JAX reads any of it:
    its shapes' text (`_dims.parse`), exactly `vjp_order` orders of derivatives,
    its platforms, device count, meshes and calling convention, no effects, and its
    inputs and outputs as flat sequences. Takes time linear in `len(data)`."""
    flatbuffers = jax_private.export_flatbuffers
    if flatbuffers is None:  # pragma: no cover - the canary test names it
        raise PayloadError(
            "program",
            "this version of JAX stores programs in a form that this version of "
            "filterjit cannot check before JAX reads it, so it loads none. Use "
            "a version of filterjit made for this JAX.",
        )
    reading = _Reading(data)
    try:
        level: Any = flatbuffers.Exported.GetRootAs(data, 0)
        for order in range(vjp_order + 1):
            if level is None:
                raise _refused(
                    f"its header says that it holds {vjp_order} orders of "
                    f"derivatives (`vjp_order`), and it holds {order - 1}"
                )
            _check_level(flatbuffers, level, reading, order == 0)
            level = level.Vjp()
        if level is not None:
            raise _refused(
                "it holds derivatives that its header does not declare "
                f"(`vjp_order` {vjp_order}), which the loader would not check"
            )
    except PayloadError:
        raise
    except Exception as error:  # the flatbuffer reader's, on bytes out of range
        raise _refused(f"it cannot be read ({type(error).__name__})") from None


def _length(table: Any, field: str) -> int:
    """The length of a vector field of a flatbuffer table; 0 where this JAX's
    schema has no such field (older ones write every aval and sharding in place,
    with no table of unique ones)."""
    length = getattr(table, f"{field}Length", None)
    return 0 if length is None else length()


def _check_level(flat: Any, level: Any, reading: _Reading, first: bool) -> None:
    """One `Exported` of the program: the function or one of its derivatives."""
    module = level.MlirModuleSerializedAsNumpy()
    _need(
        not isinstance(module, int) and bytes(module[:4]) == MLIR_BYTECODE,
        "it holds no StableHLO module in MLIR's bytecode",
    )
    platforms = [
        reading.string(level.Platforms(i), "a platform")
        for i in range(reading.count(level.PlatformsLength(), 4, "its platforms"))
    ]
    _need(
        0 < len(platforms) == len(set(platforms))
        and all(p in PLATFORMS for p in platforms),
        f"its platforms {platforms[:8]} are not distinct ones of {list(PLATFORMS)}",
    )
    devices = level.NrDevices() or level.NrDevicesShort()
    _need(1 <= devices <= MAX_DEVICES, f"it is for {devices} devices")
    version = level.CallingConventionVersion()
    lowest = jax.export.minimum_supported_calling_convention_version
    highest = jax.export.maximum_supported_calling_convention_version
    _need(
        lowest <= version <= highest,
        f"its calling convention is version {version}, and this JAX reads "
        f"versions {lowest} to {highest}",
    )
    _need(
        level.OrderedEffectsLength() == 0 and level.UnorderedEffectsLength() == 0,
        "it has effects, which an export of filterjit has none of",
    )
    for i in range(reading.count(level.DisabledChecksLength(), 4, "its checks")):
        target = level.DisabledChecks(i).CustomCallTarget()
        if target is not None:
            reading.string(target, "a custom call's target")
    for i in range(reading.count(_length(level, "UniqueAvals"), 4, "its avals")):
        reading.shape(level.UniqueAvals(i))
    unique_avals = _length(level, "UniqueAvals")
    for i in range(reading.count(level.InAvalsLength(), 4, "its inputs")):
        reading.shape(level.InAvals(i))
    for i in range(reading.count(level.OutAvalsLength(), 4, "its outputs")):
        reading.shape(level.OutAvals(i))
    inputs = _length(level, "InAvalsIdxs") or level.InAvalsLength()
    outputs = _length(level, "OutAvalsIdxs") or level.OutAvalsLength()
    for field in ("InAvalsIdxs", "OutAvalsIdxs"):
        for i in range(reading.count(_length(level, field), 4, "its avals' indices")):
            index = getattr(level, field)(i)
            _need(0 <= index < unique_avals, "an aval's index is out of range")
    kept = level.ModuleKeptVarIdxAsNumpy()
    kept = [] if isinstance(kept, int) else kept.tolist()
    _need(
        kept == sorted(set(kept)) and all(0 <= i < inputs for i in kept),
        f"it keeps inputs {kept[:8]} of {inputs}",
    )
    _check_tree(flat, level.InTree(), inputs, True, first)
    _check_tree(flat, level.OutTree(), outputs, False, first)
    abstract = reading.count(_length(level, "UniqueAbstractMeshes"), 4, "meshes")
    meshes = [level.UniqueAbstractMeshes(i) for i in range(abstract)]
    shardings = reading.count(_length(level, "UniqueNamedShardings"), 4, "shardings")
    for i in range(shardings):
        meshes.append(level.UniqueNamedShardings(i).Mesh())
    for i in range(reading.count(level.InShardingsLength(), 4, "shardings")):
        named = level.InShardings(i).NamedSharding()
        meshes.append(None if named is None else named.Mesh())
    for i in range(reading.count(level.OutShardingsLength(), 4, "shardings")):
        named = level.OutShardings(i).NamedSharding()
        meshes.append(None if named is None else named.Mesh())
    for mesh in meshes:
        if mesh is None:
            continue
        sizes = mesh.AxisSizesAsNumpy()
        sizes = [] if isinstance(sizes, int) else sizes.tolist()
        _need(
            all(size >= 1 for size in sizes) and math.prod(sizes) <= devices,
            f"a mesh of axes {sizes[:8]} is larger than its {devices} devices",
        )
        for i in range(reading.count(mesh.AxisNamesLength(), 4, "a mesh's axes")):
            reading.string(mesh.AxisNames(i), "a mesh's axis")


def _check_tree(flat: Any, tree: Any, count: int, inputs: bool, first: bool) -> None:
    """A program's `in_tree`, `((x0, x1, ...), {})`, or `out_tree`, a list (a
    derivative's: a tuple) of its outputs, before JAX builds either."""
    kind = flat.PyTreeDefKind
    _need(tree is not None, "it has no input or output structure")

    def leaves(node: Any, node_kind: int) -> bool:
        return (
            node.Kind() == node_kind
            and node.ChildrenLength() == count
            and all(node.Children(i).Kind() == kind.leaf for i in range(count))
        )

    if inputs:
        _need(
            tree.Kind() == kind.tuple
            and tree.ChildrenLength() == 2
            and leaves(tree.Children(0), kind.tuple)
            and tree.Children(1).Kind() == kind.dict
            and tree.Children(1).ChildrenLength() == 0,
            "its inputs are not positional arrays, as an export of filterjit's are",
        )
    else:
        _need(
            leaves(tree, kind.list if first else kind.tuple),
            "its outputs are not a list of arrays, as an export of filterjit's are",
        )


# -- After JAX read it: its entry point against its avals and its header.


class EntryPoint(NamedTuple):
    """A program's `main` function: its inputs' and results' types as StableHLO
    writes them (`tensor<?x3xf32>`), and whether each input is donated."""

    inputs: list[str]
    results: list[str]
    donated: list[bool]


def _top_level_split(text: str) -> tuple[list[str], int]:
    """The comma-separated parts of `text`, from the bracket it begins with to the
    one that closes it, and where that one ends; quoted strings and nested
    brackets are skipped."""
    closing = {"(": ")", "<": ">", "{": "}", "[": "]"}
    parts, start, expected = [], 1, []
    position, quoted = 0, False
    while position < len(text):
        char = text[position]
        if quoted:
            if char == "\\":
                position += 1  # what it escapes
            elif char == '"':
                quoted = False
        elif char == '"':
            quoted = True
        elif char in closing:
            expected.append(closing[char])
        elif expected and char == expected[-1]:
            expected.pop()
            if not expected:
                parts.append(text[start:position])
                return [part for part in parts if part.strip()], position + 1
        elif char == "," and len(expected) == 1:
            parts.append(text[start:position])
            start = position + 1
        position += 1
    raise _refused("its entry point cannot be read")


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_TYPE = re.compile(r"tensor<|!stablehlo\.token|[a-z0-9]+")


def _leading_type(text: str) -> str:
    """The type that `text` (an input or a result of the entry point) begins with,
    its nested brackets included."""
    match = _TYPE.match(text)
    _need(match is not None, "an input or result of its entry point has no type")
    assert match is not None
    if match.group() != "tensor<":
        return match.group()
    depth = 0
    for position, char in enumerate(text):
        depth += {"<": 1, ">": -1}.get(char, 0)
        if depth == 0 and char == ">":
            return text[: position + 1]
    raise _refused("an input or result of its entry point has no type")


def entry_point(text: str) -> EntryPoint:
    """The `main` function of a module's text (`exported.mlir_module()`)."""
    start = text.find("func.func public @main(")
    _need(start >= 0, "it has no entry point `main`")
    line = text[start + len("func.func public @main") :]
    arguments, end = _top_level_split(line)
    rest = line[end:].lstrip()
    results: list[str] = []
    if rest.startswith("->"):
        rest = rest[2:].lstrip()
        if rest.startswith("("):
            results, _ = _top_level_split(rest)
        else:
            results = [rest.split(" ", 1)[0]]
    inputs, donated = [], []
    for argument in arguments:
        _, _, typed = argument.partition(":")
        typed = typed.strip()
        inputs.append(_leading_type(typed))
        attributes = _STRING.sub('""', typed[len(inputs[-1]) :])
        donated.append(
            "tf.aliasing_output" in attributes
            or "jax.buffer_donor = true" in attributes
        )
    types = [_leading_type(result.strip()) for result in results]
    return EntryPoint(inputs, types, donated)


def _element(dtype: Any) -> str | None:
    """StableHLO's name of an element type (`f32`, `ui8`, `f8E4M3FN`), or `None`
    for one it holds by another layout (typed PRNG keys) or unknown here."""
    if dtype == jax.dtypes.float0:  # a cotangent of integers
        return "i1"
    if jnp.issubdtype(dtype, jax.dtypes.extended):
        return None
    name = np.dtype(dtype).name
    if name == "bool":
        return "i1"
    if name == "bfloat16":
        return "bf16"
    if name.startswith("complex"):
        return f"complex<f{int(name[7:]) // 2}>"
    if match := re.fullmatch(r"(u?)int(\d+)", name):
        return f"{'ui' if match[1] else 'i'}{match[2]}"
    if match := re.fullmatch(r"float(\d+)(?:_(\w+))?", name):
        return f"f{match[1]}{(match[2] or '').upper()}"
    return None


def tensor_type(aval: Any) -> str | None:
    """The type StableHLO gives an array of `aval`, `None` for an extended dtype."""
    element = _element(aval.dtype)
    if element is None:
        return None
    shape = ["?" if not isinstance(d, int) else str(d) for d in aval.shape]
    return f"tensor<{'x'.join([*shape, element])}>"


def check_entry_point(exported: jax.export.Exported, order: int) -> EntryPoint:
    """Raises `PayloadError` unless the program's entry point takes its kept
    inputs (after its platform's index, where it has several platforms) and
    returns its outputs, of their avals' types; its `out_tree` a list (a
    derivative's, a tuple) of its outputs. Returns the entry point."""
    count = len(exported.out_avals)
    tree = jtu.tree_structure([0] * count if order == 0 else (0,) * count)
    _need(exported.out_tree == tree, "its outputs are not a list of arrays")
    entry = entry_point(exported.mlir_module())
    leading = 1 if len(exported.platforms) > 1 else 0
    kept = exported.module_kept_var_idx
    _need(
        len(entry.inputs) == leading + len(kept) and len(entry.results) == count,
        f"its entry point takes {len(entry.inputs)} inputs and returns "
        f"{len(entry.results)}, where its avals are {leading + len(kept)} and "
        f"{count}",
    )
    _check_dimensions(exported)
    expected = [exported.in_avals[i] for i in kept]
    pairs = [
        *zip(entry.inputs[leading:], expected),
        *zip(entry.results, exported.out_avals),
    ]
    for found, aval in pairs:
        wanted = tensor_type(aval)
        _need(
            wanted is None or found == wanted,
            f"its entry point has {found} where its aval is {aval.str_short()}",
        )
    return entry


def _check_dimensions(exported: jax.export.Exported) -> None:
    """Raises unless each dimension the outputs name is one the inputs name, and JAX
    solves the inputs' dimensions from their shapes (as it does at a call)."""
    named = [
        dims.names(dims.parse(str(d)))
        for aval in exported.in_avals
        for d in aval.shape
        if not isinstance(d, int)
    ]
    given = set().union(*named)
    for aval in exported.out_avals:
        for d in aval.shape:
            if not isinstance(d, int):
                unknown = dims.names(dims.parse(str(d))) - given
                _need(
                    not unknown,
                    f"its outputs name dimensions {sorted(unknown)} "
                    "that its inputs do not",
                )
    if given:
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exported.in_avals]
        try:
            jax.eval_shape(exported.call, *specs)
        except Exception as error:  # JAX's shape checks, of JAX's own program
            raise _refused(
                f"JAX cannot solve its inputs' dimensions ({type(error).__name__})"
            ) from None


def donated_inputs(exported: jax.export.Exported, entry: EntryPoint) -> list[int]:
    """The inputs (of `in_avals`) that the program's entry point donates."""
    leading = len(entry.inputs) - len(exported.module_kept_var_idx)
    return [
        kept
        for kept, donated in zip(exported.module_kept_var_idx, entry.donated[leading:])
        if donated
    ]
