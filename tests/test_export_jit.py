"""`filterjit.export` of a `filterjit.jit` wrapper: exported with its keywords, as
`jax.export.export` exports it (donation, shardings)."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from helpers import subprocess_env

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
