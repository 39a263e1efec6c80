"""A payload fuzzer in the default tier: crafted payloads (their checksums
recomputed) made by mutating every part of a valid one, each loaded and called in
this process. Each either is refused at load with `PayloadError`, or loads and
computes what the original did, or loads and its call is refused with the
documented call error naming the argument (a static value saved in the header,
which the program compiled in, is the header's word alone), or returns the same
arrays with other static outputs (the header's word alone too). None takes more
than `_BOUND` seconds. The JAX reader's parsing of StableHLO bytecode is not
fuzzed here (a crafted module can abort the process: tests/test_export_payload.py
tries those in child processes)."""

import dataclasses
import hashlib
import json
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.core import ShapedArray

import filterjit
from filterjit._export._payload import FORMAT, MAGIC, pack, unpack


_BOUND = 5.0  # seconds, for one mutation's load and call (type-checked, 2 cores)


class _Scaled(eqx.Module):
    weight: jax.Array
    power: int = eqx.field(static=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.weight * x**self.power


def _served(model: _Scaled, xs: jax.Array, mode: str) -> Any:
    ys = jax.vmap(model)(xs)
    return ys, {"mode": mode, "size": xs.shape[0], "tags": frozenset({1, 2})}


def _original() -> tuple[bytes, tuple[Any, ...]]:
    (batch,) = jax.export.symbolic_shape("batch")
    model = _Scaled(jnp.arange(3.0), 2)
    spec = jax.ShapeDtypeStruct((batch, 3), jnp.float32)
    exported = filterjit.export(_served)(model, spec, "serve")
    arguments = (model, jnp.arange(12.0).reshape(4, 3), "serve")
    return exported.serialize(vjp_order=1), arguments


def _paths(data: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path of every value in JSON data, itself first."""
    yield path
    if isinstance(data, dict | list):
        items = data.items() if isinstance(data, dict) else enumerate(data)
        for key, value in items:
            yield from _paths(value, (*path, key))


def _replaced(data: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    copy = json.loads(json.dumps(data))
    parent = copy
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return copy


def _nested(depth: int) -> str:
    """Saved data nested `depth` lists deep, as JSON text."""
    return '["list", [' * depth + '["none"]' + "]]" * depth


_DEEP = "<nested 100,000 deep>"  # replaced by `_nested(100_000)` in the text


_COLLIDING = ["frozenset", [["int", str(k * (2**61 - 1))] for k in range(2000)]]
# What each value of the header is replaced by.
_VALUES: list[Any] = [
    None,
    True,
    -1,
    0,
    99,
    2**70,
    1.5,
    "",
    "x" * 100_000,
    [],
    {},
    ["traced"],
    ["size"],
    ["int", "9" * 5000],
    ["ref", "jax.numpy:save"],
    ["ref", "os:system"],
    ["node", "builtins.object", []],
    ["dict", [[["list", []], ["none"]]]],
    json.loads(_nested(150)),
    _DEEP,
    _COLLIDING,
    ["dict", [[member, ["none"]] for member in _COLLIDING[1]]],
]


def _header_mutations(header: dict[str, Any], program: bytes) -> list[bytes]:
    """Every value of the header (each object, list and scalar) replaced by two
    of `_VALUES`, taken in turn so that each is tried at many places."""
    return [
        _with_header_text(
            json.dumps(_replaced(header, path, _VALUES[(2 * i + j) % len(_VALUES)])),
            program,
        )
        for i, path in enumerate(_paths(header))
        for j in range(2)
    ]


def _with_header_text(text: str, program: bytes) -> bytes:
    """A payload of this header's text (any JSON, or none) and `program`, its
    lengths and checksum made to match."""
    encoded = text.replace(json.dumps(_DEEP), _nested(100_000)).encode()
    body = MAGIC + FORMAT.to_bytes(4, "big") + len(encoded).to_bytes(8, "big")
    body += len(program).to_bytes(8, "big") + encoded + program
    return body + hashlib.sha256(body).digest()


def _duplicated_keys(header: dict[str, Any], program: bytes) -> list[bytes]:
    """Each key of each object of the header written twice (the first copy with
    another value)."""
    found = []
    for path in _paths(header):
        value = header
        for key in path:
            value = value[key]
        if not isinstance(value, dict):
            continue
        for key in value:
            marker = {"__first__": None, **value}
            text = json.dumps(_replaced(header, path, marker))
            found.append(
                _with_header_text(
                    text.replace('"__first__"', json.dumps(key), 1), program
                )
            )
    return found


def _program_ranges(program: bytes, vjp_order: int) -> list[range]:
    """Where the program's StableHLO modules (bytecode) lie in its bytes."""
    exported = jax.export.deserialize(bytearray(program))
    ranges = []
    for order in range(vjp_order + 1):
        module = exported.mlir_module_serialized
        start = program.find(module)
        assert start >= 0
        ranges.append(range(start, start + len(module)))
        if order < vjp_order:
            exported = exported.vjp()
    return ranges


def _program_mutations(
    header: dict[str, Any], program: bytes, count: int, seed: int
) -> list[bytes]:
    """The program's bytes outside its modules (the serialized `Exported`: its
    shapes, trees, platforms, versions, offsets) changed: single bits, bytes,
    whole words; and the dimension's name replaced by other text."""
    rng = np.random.default_rng(seed)
    modules = _program_ranges(program, header["vjp_order"])
    outside = [i for i in range(len(program)) if not any(i in r for r in modules)]
    found = []
    for _ in range(count):
        changed = bytearray(program)
        kind = int(rng.integers(3))
        position = outside[int(rng.integers(len(outside)))]
        if kind == 0:
            changed[position] ^= 1 << int(rng.integers(8))
        elif kind == 1:
            changed[position] = int(rng.integers(256))
        else:
            word = position - position % 4
            changed[word : word + 4] = rng.bytes(4) if rng.integers(2) else bytes(4)
        found.append(pack(header, bytes(changed)))
    for text in (
        b"b^99",
        b"9^99",
        b"b, c",
        b"(b) ",
        b"b**2",
        b"in  ",
        b"9999",
        b"-1  ",
        b"0   ",
        b"max(",
        b"b*c ",
        b"\xff\xfe\x00\x01",
    ):
        found.append(pack(header, program.replace(b"batch", text.ljust(5))))
    return found


def _crafted(header: dict[str, Any], program: bytes) -> list[bytes]:
    """Derivatives, donations and versions the program does not hold."""
    without_derivative = unpack(
        filterjit.export(_served)(
            _Scaled(jnp.arange(3.0), 2), jnp.ones((4, 3)), "serve"
        ).serialize()
    )[1]
    exported = jax.export.deserialize(bytearray(program))
    huge = jax.export.symbolic_shape(" + ".join(f"d{i}" for i in range(300)))
    wide = ShapedArray((*huge, 3), jnp.float32)
    changed = {
        "in_avals": (wide, *exported.in_avals[1:]),
        "nr_devices": (1 << 32) - 1,
        "platforms": ("cpu",) * 1000,
    }
    reprogrammed = [
        pack(
            header,
            bytes(dataclasses.replace(exported, **{k: v}).serialize(vjp_order=1)),
        )
        for k, v in changed.items()
    ]
    return [
        *reprogrammed,
        pack({**header, "vjp_order": 0}, program),
        pack({**header, "vjp_order": 2}, program),
        pack({**header, "vjp_order": 1}, without_derivative),
        *(
            pack({**header, "donated": d}, program)
            for d in ([0], [1], [-1], [99], [0, 0])
        ),
        pack({**header, "jax": "99.0.0"}, program),
        pack(header, b""),
        pack(header, program[: len(program) // 2]),
    ]


def _outcome(payload: bytes, arguments: tuple[Any, ...], expected: Any) -> str:
    try:
        loaded = filterjit.deserialize(payload)
    except filterjit.PayloadError:
        return "refused"
    try:
        found = loaded.call(*arguments)
    except (TypeError, ValueError) as error:
        assert str(error).startswith(f"{loaded.fun_name}: "), error
        assert "argument" in str(error), error
        return "call refused"
    # The program's arrays are its own; what else the output holds is the
    # header's word.
    assert isinstance(found, tuple) and isinstance(found[0], jax.Array)
    assert found[0].dtype == expected[0].dtype and found[0].shape == expected[0].shape
    assert bool(jnp.array_equal(found[0], expected[0]))
    return "same" if _same(found, expected) else "other statics"


def _same(found: Any, expected: Any) -> bool:
    """Whether two outputs are one: structure, arrays and static leaves (by type
    and value)."""
    leaves, treedef = jax.tree.flatten(found)
    expected_leaves, expected_treedef = jax.tree.flatten(expected)
    return treedef == expected_treedef and all(
        type(a) is type(b)
        and (bool(jnp.array_equal(a, b)) if isinstance(a, jax.Array) else bool(a == b))
        for a, b in zip(leaves, expected_leaves)
    )


@pytest.mark.filterwarnings("ignore")
def test_every_mutation_is_refused_or_computes_what_the_original_did() -> None:
    data, arguments = _original()
    expected = filterjit.deserialize(data).call(*arguments)
    header, program = unpack(data)
    mutations = {
        "header values": _header_mutations(header, program),
        "duplicated keys": _duplicated_keys(header, program),
        "program bytes": _program_mutations(header, program, 100, seed=0),
        "crafted": _crafted(header, program),
    }
    counts: dict[str, Counter[str]] = {}
    slowest = 0.0
    start = time.perf_counter()
    times = {}
    for family, payloads in mutations.items():
        counts[family] = Counter()
        family_start = time.perf_counter()
        for payload in payloads:
            begun = time.perf_counter()
            counts[family][_outcome(payload, arguments, expected)] += 1
            slowest = max(slowest, time.perf_counter() - begun)
        times[family] = round(time.perf_counter() - family_start, 1)
    total = time.perf_counter() - start
    # Reported, for a reader of the output (`-s`, or on failure).
    print(
        f"payload fuzz: {counts}; {times}; slowest {slowest:.2f} s, all {total:.1f} s"
    )
    assert slowest < _BOUND
    assert counts["duplicated keys"] == Counter(
        {"refused": len(mutations["duplicated keys"])}
    )
    assert counts["crafted"]["refused"] == len(mutations["crafted"])
    assert counts["header values"]["refused"] > 0.9 * len(mutations["header values"])
