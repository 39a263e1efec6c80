"""`filterjit.export` of a `filterjit.jit` wrapper: exported with its keywords, as
`jax.export.export` exports it (donation, shardings)."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import one_device_sharding, subprocess_env

import filterjit


def _step(x: jax.Array, y: jax.Array) -> jax.Array:
    return 2 * x + y


def _main_signature(exported: Any) -> str:
    (line,) = [line for line in exported.mlir_module().splitlines() if "@main" in line]
    return line


def test_a_jit_wrappers_donation_is_exported() -> None:
    wrapper = filterjit.jit(_step, donate_argnums=0)
    exported = filterjit.export(wrapper)(jnp.ones(3), jnp.ones(3))
    by_jax = jax.export.export(wrapper._outside)(jnp.ones(3), jnp.ones(3))
    assert "tf.aliasing_output = 0" in _main_signature(by_jax)
    main = _main_signature(exported)
    assert main.count("tf.aliasing_output = 0") == 1
    assert main.index("tf.aliasing_output") < main.index("%arg1")
    for served in (exported, filterjit.deserialize(exported.serialize())):
        x, y = jnp.ones(3), jnp.ones(3)
        assert served.call(x, y).tolist() == [3.0] * 3
        assert x.is_deleted() and not y.is_deleted()
    # By name, as jax.jit's donate_argnames.
    by_name = filterjit.jit(_step, donate_argnames="y")
    x, y = jnp.ones(3), jnp.ones(3)
    filterjit.export(by_name)(x, y).call(x, y)
    assert y.is_deleted() and not x.is_deleted()


def _collected(*xs: jax.Array) -> jax.Array:
    return sum(xs, jnp.zeros(3))


def test_a_keyword_that_cannot_be_exported_is_named() -> None:
    wrapper = filterjit.jit(_collected, donate_argnums=1)
    with pytest.raises(TypeError, match=r"_collected has donate_argnums=1, which is"):
        filterjit.export(wrapper)(jnp.ones(3), jnp.ones(3))


# Run with two CPU devices: a wrapper's shardings, exported by filterjit and by JAX.
SHARDED = """
import json

import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import filterjit

mesh = jax.make_mesh((2,), ("a",))
sharding = NamedSharding(mesh, PartitionSpec("a"))

def scaled(x, n, y):
    return x * n + y

wrapper = filterjit.jit(
    scaled, in_shardings=(sharding, sharding), out_shardings=sharding,
    static_argnums=1,
)
x, y = jnp.arange(4.0), jnp.ones(4)  # exported from arrays of one device
ours = filterjit.deserialize(filterjit.export(wrapper)(x, 2, y).serialize())
theirs = jax.export.deserialize(jax.export.export(wrapper)(x, 2, y).serialize())
x, y = jax.device_put(x, sharding), jax.device_put(y, sharding)
found, expected = ours.call(x, 2, y), theirs.call(x, y)
print(json.dumps({
    "devices": [ours.nr_devices, theirs.nr_devices],
    "values": [found.tolist(), expected.tolist()],
    "same_sharding": found.sharding.is_equivalent_to(expected.sharding, 1),
}))
"""


def test_a_jit_wrappers_shardings_are_exported() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SHARDED],
        capture_output=True,
        text=True,
        env=subprocess_env(
            Path(__file__).parent,
            XLA_FLAGS="--xla_force_host_platform_device_count=2",
            JAX_PLATFORMS="cpu",
        ),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["devices"] == [2, 2]
    assert report["values"] == [[1.0, 3.0, 5.0, 7.0]] * 2
    assert report["same_sharding"] is True


def _gated(x: jax.Array, n: Any) -> jax.Array:
    return x * int(n) if n > 2 else x  # `n` read in Python: static, as jax.jit has it


def test_a_jit_wrappers_static_arguments_are_static_of_any_type() -> None:
    # Finding 13: `static_argnums=1` with a NumPy scalar was traced by the export
    # (`TracerBoolConversionError`), where `jax.export.export` of the wrapper
    # compiles it in.
    for wrapper in (
        filterjit.jit(_gated, static_argnums=1),
        filterjit.jit(_gated, static_argnames="n"),
    ):
        exported = filterjit.export(wrapper)(jnp.ones(3), np.int32(3))
        by_jax = jax.export.export(wrapper._outside)(jnp.ones(3), np.int32(3))
        assert list(exported.in_avals.values()) == list(by_jax.in_avals)
        for served in (exported, filterjit.deserialize(exported.serialize())):
            assert served.call(jnp.ones(3), np.int32(3)).tolist() == [3.0] * 3
            assert served.call(jnp.ones(3), n=np.int32(3)).tolist() == [3.0] * 3
            with pytest.raises(ValueError, match=r"static argument `n` was np.int32"):
                served.call(jnp.ones(3), np.int32(4))
            with pytest.raises(ValueError, match=r"static argument `n` was"):
                served.call(jnp.ones(3), 3)  # another type: another program
    # A hashable value a payload cannot hold is held in this process.
    hashable = _Threshold(3)
    exported = filterjit.export(filterjit.jit(_gated, static_argnums=1))(
        jnp.ones(3), hashable
    )
    assert exported.call(jnp.ones(3), _Threshold(3)).tolist() == [3.0] * 3
    with pytest.raises(TypeError, match="cannot save `n`"):
        exported.serialize()


class _Threshold:
    def __init__(self, value: int):
        self.value = value

    def __gt__(self, other: int) -> bool:
        return self.value > other

    def __int__(self) -> int:
        return self.value

    def __eq__(self, other: object) -> bool:
        return type(other) is _Threshold and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)


def test_in_shardings_of_a_function_of_star_args() -> None:
    # Finding 13: `in_shardings=(s, s)` for `def f(*xs)` was refused ("got ()").
    sharding = one_device_sharding(jax.devices()[0])
    wrapper = filterjit.jit(_collected, in_shardings=(sharding, sharding))
    exported = filterjit.export(wrapper)(jnp.ones(3), jnp.ones(3))
    for served in (exported, filterjit.deserialize(exported.serialize())):
        assert served.call(jnp.ones(3), 2 * jnp.ones(3)).tolist() == [3.0] * 3


# Run with four CPU devices: the shardings a 2x2 mesh gives the program's entry
# point, exported by filterjit and by JAX.
MESH = """
import json

import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import filterjit

mesh = jax.make_mesh((2, 2), ("a", "b"))
rows = NamedSharding(mesh, PartitionSpec("a", "b"))
wrapper = filterjit.jit(lambda x, y: x @ y, in_shardings=(rows, rows))
x = jnp.arange(16.0).reshape(4, 4)
ours = filterjit.export(wrapper)(x, x)
theirs = jax.export.export(wrapper._outside)(x, x)
loaded = filterjit.deserialize(ours.serialize())
def recorded(exported):
    return [
        s is not None and s.is_equivalent_to(rows, 2)
        for s in exported.in_shardings_jax(mesh)
    ]

print(json.dumps({
    "ours": recorded(ours.exported),
    "loaded": recorded(loaded.exported),
    "theirs": recorded(theirs),
    "values": [loaded.call(*[jax.device_put(x, rows)] * 2).tolist(), (x @ x).tolist()],
}))
"""


def test_a_jit_wrappers_shardings_are_the_programs_entry_points() -> None:
    # Finding 13: on a 2x2 mesh the program's entry point had no shardings, where
    # `jax.export.export` of the wrapper records them.
    done = subprocess.run(
        [sys.executable, "-c", MESH],
        capture_output=True,
        text=True,
        env=subprocess_env(
            XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu"
        ),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["ours"] == report["theirs"] == report["loaded"] == [True, True]
    assert report["values"][0] == report["values"][1]
