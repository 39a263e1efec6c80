"""`filterjit.deserialize` checks everything a payload's header says against its
program, and the program's own text within fixed limits before JAX reads it: each
crafted payload here (its checksum recomputed) is refused with `PayloadError`,
promptly, and builds nothing from the data it refuses."""

import dataclasses
import enum
import hashlib
import json
import subprocess
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import subprocess_env
from jax.core import ShapedArray

import filterjit
from filterjit._export._payload import MAGIC, pack, unpack


def _step(x: jax.Array, y: jax.Array) -> jax.Array:
    return 2 * x + y


def _static(x: jax.Array, n: Any) -> Any:
    return x * 2, "tag"


def _refused(data: bytes, region: str, match: str) -> filterjit.PayloadError:
    with pytest.raises(filterjit.PayloadError, match=match) as caught:
        filterjit.deserialize(data)
    assert caught.value.region == region
    return caught.value


# -- Security.


@jax.custom_vjp
def _hidden(x: jax.Array) -> jax.Array:
    return jnp.sin(x)


def _hidden_forward(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jnp.sin(x), x


def _hidden_backward(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    # The target `jax.pure_callback` lowers to on a CPU: a host callback that
    # names an address of the exporting process.
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return (jax.ffi.ffi_call("xla_ffi_python_cpu_callback", out)(g),)


_hidden.defvjp(_hidden_forward, _hidden_backward)


def test_a_derivative_the_header_does_not_declare_is_refused() -> None:
    # Finding 1: the program holds a derivative that calls a host callback, and
    # the header says it holds none (`vjp_order: 0`): `jax.grad` of the loaded
    # call would run it (a segfault). Refused at load, whatever the header says.
    allowed = [
        jax.export.DisabledSafetyCheck.custom_call("xla_ffi_python_cpu_callback")
    ]
    exported = filterjit.export(_hidden, disabled_checks=allowed)(jnp.ones(3))
    header, _ = unpack(exported.serialize(vjp_order=0))
    _, with_derivative = unpack(exported.serialize(vjp_order=1))
    assert header["vjp_order"] == 0
    _refused(pack(header, with_derivative), "program", "does not declare")
    # Declared, its custom calls are checked at every order it holds.
    declared = exported.serialize(vjp_order=1)
    _refused(declared, "program", "`xla_ffi_python_cpu_callback`, a host callback")
    # Claimed and not held.
    _refused(pack({**header, "vjp_order": 2}, with_derivative), "program", "holds 1")


def _renamed_dimension(data: bytes, old: bytes, new: bytes) -> bytes:
    """A payload whose program's shapes name the dimension `old` as `new` (as
    long), its checksum recomputed."""
    header, program = unpack(data)
    assert len(old) == len(new) and old in program
    return pack(header, program.replace(old, new))


def test_shapes_are_bounded_before_jax_reads_them() -> None:
    # Finding 2: JAX's reader of shapes evaluates `k^n`, and expands `b^n` into n
    # multiplications (25 s for `b^3000000`, 800 MB for `b^99999999`). Each is
    # refused before JAX reads it, in well under a second.
    (batch,) = jax.export.symbolic_shape("batchsize1")
    spec = jax.ShapeDtypeStruct((batch, 3), jnp.float32)
    data = filterjit.export(_step)(spec, jnp.ones(3)).serialize()
    for crafted in (
        b"b^200000  ",
        b"9^99999999",
        b"b^99999999",
        b"((((b)))) ",
        b"b, c, d, e",
        b"2**b      ",
        b"max(a+b+c,",
        b"lambda: 1 ",
        b"0x1f      ",
    ):
        start = time.perf_counter()
        error = _refused(
            _renamed_dimension(data, b"batchsize1", crafted), "program", "dimension"
        )
        assert time.perf_counter() - start < 1.0, (crafted, error)


def test_a_product_that_expands_past_the_limit_is_refused_promptly() -> None:
    # Sums multiplied together (what `max` and `min` of sums may simplify to) make
    # JAX's reader expand terms exponentially: the number of terms is bounded.
    from filterjit._export import _dims

    factor = "max(a + b + c, 1)"
    with pytest.raises(_dims.DimensionError, match="more than 256 terms"):
        _dims.parse("*".join([factor] * 5))
    assert _dims.parse("*".join([factor] * 4))[0] == "sum"  # 4^4 terms: 256
    with pytest.raises(_dims.DimensionError, match="longer than"):
        _dims.parse("b + " * 300 + "1")
    with pytest.raises(_dims.DimensionError, match="nested deeper"):
        _dims.parse("max(" * 9 + "b" + ", 1)" * 9)


def test_a_donation_the_program_does_not_make_is_refused() -> None:
    # Finding 3: `donated: [0]` on a program that donates nothing made `call`
    # delete the caller's array (a model's weights).
    data = filterjit.export(_step)(jnp.ones(3), jnp.ones(3)).serialize()
    header, program = unpack(data)
    assert header["donated"] == []
    _refused(pack({**header, "donated": [0]}, program), "header", "donates inputs")
    # And one the program makes, that the header leaves out.
    donating = filterjit.jit(_step, donate_argnums=0)
    data = filterjit.export(donating)(jnp.ones(3), jnp.ones(3)).serialize()
    header, program = unpack(data)
    assert header["donated"] == [0]
    _refused(pack({**header, "donated": [1]}, program), "header", "donates inputs")
    x = jnp.ones(3)
    filterjit.deserialize(data).call(x, jnp.ones(3))
    assert x.is_deleted()


# Run by a fresh interpreter (no type-checking instrumentation, which would time
# the checks' Python rather than the hashing): how long loading takes where a
# saved frozenset's 20,000 ints have distinct hashes and where they all collide
# (`hash(k * M) == 0`, `M` the modulus of Python's hash of ints).
HASHING = """
import json, time
import jax.numpy as jnp
import filterjit
from filterjit._export._payload import pack, unpack

def static(x, n):
    return x * 2, "tag"

data = filterjit.export(static)(jnp.ones(3), frozenset({1, 2})).serialize()
header, program = unpack(data)
filterjit.deserialize(data)  # JAX's first reading of a program, not timed
report = {}
for where in ("argument", "output"):
    for colliding in (False, True):
        step = 2**61 - 1 if colliding else 1
        members = ["frozenset", [["int", str(k * step)] for k in range(20_000)]]
        crafted = json.loads(json.dumps(header))
        if where == "argument":
            crafted["arguments"][1]["value"] = members
        else:
            crafted["output"] = ["tuple", [["traced"], members]]
        payload = pack(crafted, program)
        start = time.perf_counter()
        try:
            filterjit.deserialize(payload)
            outcome = "loaded"
        except filterjit.PayloadError as error:
            outcome = error.region
        report[f"{where} {colliding}"] = [time.perf_counter() - start, outcome]
print(json.dumps(report))
"""


def test_checking_a_saved_value_builds_nothing_hashable() -> None:
    # Finding 4: checking an argument's saved frozenset built it, and ints whose
    # hashes collide made that quadratic (20,000 members: 5.9 s, where 20,000 of
    # distinct hashes take milliseconds). Loading takes as long either way; an
    # output's frozenset, which is built, is refused if more than a few of its
    # members collide.
    done = subprocess.run(
        [sys.executable, "-c", HASHING],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    for where in ("argument", "output"):
        distinct, colliding = report[f"{where} False"], report[f"{where} True"]
        assert colliding[0] < 3 * distinct[0] + 0.5, report
    assert report["argument True"][1] == "loaded"
    assert report["output False"][1] == "loaded"
    assert report["output True"][1] == "header"


def test_functions_that_touch_files_or_processes_are_not_named() -> None:
    # Finding 5: the loader never calls them, but an output's field can hand them
    # to user code.
    data = filterjit.export(_static)(jnp.ones(3), 1).serialize()
    header, program = unpack(data)
    for name in (
        "jax.numpy:save",
        "jax.numpy:savez",
        "jax.numpy:load",
        "jax.numpy:fromfile",
        "equinox:tree_serialise_leaves",
        "equinox:tree_deserialise_leaves",
        "equinox:filter_pure_callback",
    ):
        output = ["tuple", [["traced"], ["ref", name]]]
        _refused(pack({**header, "output": output}, program), "header", "not among")
    # Nor are they saved.
    with pytest.raises(TypeError, match="cannot save `output"):
        filterjit.export(lambda x: (x, jnp.save))(jnp.ones(3)).serialize()


# -- One error, for every refusal at load.


class _Colour(enum.Enum):
    RED = 1


@dataclasses.dataclass
class _Unhashable:
    value: Any


filterjit.register_serializable(_Colour)
filterjit.register_serializable(_Unhashable)


def test_every_refusal_at_load_is_a_payload_error() -> None:
    # Finding 6: decoding an output re-raised `TypeError`s unchanged (310 of 6,224
    # header mutations), and an enum named as a node said "must be called with a
    # dataclass type".
    data = filterjit.export(_static)(jnp.ones(3), 1).serialize()
    header, program = unpack(data)
    colour = f"{__name__}._Colour"
    unhashable = f"{__name__}._Unhashable"
    outputs = [
        ["node", colour, []],
        ["enum", unhashable, "RED"],
        ["frozenset", [["node", unhashable, [["value", ["int", "1"]]]]]],
        ["dict", [[["list", []], ["none"]]]],
        ["float", "0x1p99999"],
        ["bytes", "not base64!"],
        ["node", "not.Registered", []],
        ["ref", "not.registered"],
    ]
    for output in outputs:
        crafted = {**header, "output": ["tuple", [["traced"], output]]}
        _refused(pack(crafted, program), "header", "the payload")


@dataclasses.dataclass(frozen=True)
class _Tagged:
    value: Any
    tag: Any


jax.tree_util.register_dataclass(_Tagged, data_fields=["value"], meta_fields=["tag"])
filterjit.register_serializable(_Tagged)


def test_an_array_marked_where_the_output_has_no_leaf_is_refused() -> None:
    # Finding 7: `["traced"]` in a static field, a frozenset or a dict's key
    # loaded, and every call then raised a bare `StopIteration`.
    data = filterjit.export(lambda x: _Tagged(x, "a"))(jnp.ones(3)).serialize()
    header, program = unpack(data)
    name = f"{__name__}._Tagged"
    for output in (
        ["node", name, [["value", ["traced"]], ["tag", ["traced"]]]],
        [
            "tuple",
            [
                ["node", name, [["value", ["traced"]], ["tag", ["str", "a"]]]],
                ["frozenset", [["traced"]]],
            ],
        ],
        ["tuple", [["traced"], ["dict", [[["traced"], ["none"]]]]]],
    ):
        _refused(pack({**header, "output": output}, program), "header", "marks")


def _replaced(data: bytes, **changes: Any) -> bytes:
    """A payload whose program (`jax.export.Exported`) has `changes`."""
    header, _ = unpack(data)
    exported = filterjit.deserialize(data).exported
    program = bytes(dataclasses.replace(exported, **changes).serialize())
    return pack(header, program)


def test_what_the_program_says_of_itself_is_checked() -> None:
    # Finding 8: the program's `out_tree`, platforms, device count and calling
    # convention were not checked (`out_tree` a bare array: `call` returned the
    # first element; version 999 loaded and ran).
    data = filterjit.export(jnp.sin)(jnp.ones(3)).serialize()
    leaf = jax.tree_util.tree_structure(0)
    _refused(_replaced(data, out_tree=leaf), "program", "outputs are not a list")
    as_dict = jax.tree_util.tree_structure({"a": 0})
    _refused(_replaced(data, out_tree=as_dict), "program", "outputs are not a list")
    _refused(_replaced(data, calling_convention_version=999), "program", "version 999")
    _refused(_replaced(data, platforms=("cpu", "abacus")), "program", "platforms")
    _refused(_replaced(data, platforms=()), "program", "platforms")
    _refused(_replaced(data, nr_devices=1 << 20), "program", "devices")
    # Its outputs' avals against its entry point's types.
    wrong = (ShapedArray((4,), jnp.float32),)
    _refused(_replaced(data, out_avals=wrong), "program", "entry point has")


def _with_header(payload: bytes, header: bytes) -> bytes:
    """`payload` with its header's JSON replaced by `header`, its lengths and
    checksum made to match."""
    start = len(MAGIC) + 20
    length = int.from_bytes(payload[len(MAGIC) + 4 : len(MAGIC) + 12], "big")
    program = payload[start + length : -32]
    body = payload[: len(MAGIC) + 4] + len(header).to_bytes(8, "big")
    body += len(program).to_bytes(8, "big") + header + program
    return body + hashlib.sha256(body).digest()


def test_a_key_that_appears_twice_in_the_header_is_refused() -> None:
    # JSON readers disagree on which of two equal keys wins: refused.
    data = filterjit.export(jnp.sin)(jnp.ones(3)).serialize()
    header, _ = unpack(data)
    text = json.dumps(header)
    assert text.startswith('{"format"')
    twice = text.replace('{"format"', '{"fun_name": "other", "format"', 1)
    _refused(_with_header(data, twice.encode()), "header", "appears twice")
    assert filterjit.deserialize(_with_header(data, text.encode())).fun_name == "sin"


def test_an_equinox_model_still_loads_and_computes() -> None:
    # The checks refuse none of what `serialize()` writes: a model with a
    # symbolic batch, its derivative, several platforms.
    model = eqx.nn.MLP(2, 2, 8, 1, key=jax.random.key(0))
    (batch,) = jax.export.symbolic_shape("batch")
    spec = jax.ShapeDtypeStruct((batch, 2), jnp.float32)
    serve = lambda model, xs: jax.vmap(model)(xs)  # noqa: E731
    for platforms in (None, ("cpu", "tpu")):
        exported = filterjit.export(serve, platforms=platforms)(model, spec)
        loaded = filterjit.deserialize(exported.serialize(vjp_order=2))
        xs = jnp.ones((5, 2))
        # The program compiled, as `filter_jit` compiles it (eager operations may
        # round otherwise in the last place).
        assert jnp.array_equal(
            loaded.call(model, xs), filterjit.filter_jit(serve)(model, xs)
        )
        grad = jax.grad(lambda xs: loaded.call(model, xs).sum())(xs)
        expected = jax.grad(lambda xs: serve(model, xs).sum())(xs)
        assert jnp.allclose(grad, expected)
