"""What a payload names: classes by their public names (and old payloads by their
modules' paths), the same class from another module, and first exports from
several threads at once."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from _export_models import Net
from helpers import subprocess_env

import filterjit
from filterjit._export._payload import pack, unpack


TESTS = Path(__file__).resolve().parent


def _serve(model: Any, x: jax.Array) -> jax.Array:
    return jax.vmap(model)(x)


def _names(data: Any) -> list[str]:
    """The class and function names in saved data."""
    if not isinstance(data, list) or not data:
        return []
    if data[0] in ("node", "ref", "enum"):
        found = [data[1]]
        rest = data[2] if data[0] == "node" else []
        return found + [n for _, item in rest for n in _names(item)]
    return [n for item in data[1:] for n in _names(item)]


def _renamed(data: Any, names: dict[str, str]) -> Any:
    if isinstance(data, dict):
        return {key: _renamed(value, names) for key, value in data.items()}
    if isinstance(data, list):
        return [_renamed(item, names) for item in data]
    return names.get(data, data) if isinstance(data, str) else data


def test_equinox_classes_are_saved_by_their_public_names() -> None:
    model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
    data = filterjit.export(_serve)(model, jnp.ones((3, 2))).serialize()
    header, program = unpack(data)
    names = _names(header["arguments"][0]["value"])
    assert names[:2] == ["equinox.nn.MLP", "equinox.nn.Linear"]
    assert "jax.nn:relu" in names
    # No public name holds the MLP's default last activation.
    assert "equinox.nn._mlp:_identity" in names
    private = [n for n in names if "._" in n.partition(":")[0]]
    assert set(private) == {"equinox.nn._mlp:_identity"}
    # A payload that names them by their modules' paths loads and is called.
    old = _renamed(
        header,
        {
            "equinox.nn.MLP": "equinox.nn._mlp.MLP",
            "equinox.nn.Linear": "equinox.nn._linear.Linear",
        },
    )
    assert _names(old["arguments"][0]["value"])[:2] == [
        "equinox.nn._mlp.MLP",
        "equinox.nn._linear.Linear",
    ]
    for payload in (data, pack(old, program)):
        loaded = filterjit.deserialize(payload)
        assert loaded.call(model, jnp.ones((3, 2))).shape == (3, 2)


def test_an_equinox_class_returned_loads_by_either_name() -> None:
    filterjit.register_serializable(eqx.nn.Identity)

    def identity_of(x: jax.Array) -> Any:
        return x, eqx.nn.Identity()

    data = filterjit.export(identity_of)(jnp.ones(2)).serialize()
    header, program = unpack(data)
    assert header["output"][1][1][1] == "equinox.nn.Identity"
    old = _renamed(header, {"equinox.nn.Identity": "equinox.nn._linear.Identity"})
    for payload in (data, pack(old, program)):
        _, returned = filterjit.deserialize(payload).call(jnp.ones(2))
        assert type(returned) is eqx.nn.Identity


def test_the_same_class_from_another_module_names_both_and_the_fix() -> None:
    # Saved from a script (`__main__.Net`), called with the package's `Net`.
    class Script(eqx.Module):
        weight: jax.Array

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.weight * x

    Script.__qualname__ = Script.__name__ = "Net"
    Script.__module__ = "__main__"
    data = filterjit.export(_serve)(Script(jnp.ones(2)), jnp.ones((3, 2))).serialize()
    served = filterjit.deserialize(data)
    with pytest.raises(TypeError) as caught:
        served.call(Net(jnp.ones(2)), jnp.ones((3, 2)))
    message = str(caught.value)
    assert (
        "`model` is a `_export_models.Net`, where the export has a `__main__" in message
    )
    assert "register_serializable(Net, name='__main__.Net')" in message
    filterjit.register_serializable(Net, name="__main__.Net")
    assert (
        served.call(Net(2 * jnp.ones(2)), jnp.ones((3, 2))).tolist() == [[2.0] * 2] * 3
    )


# Run by fresh interpreters: the first exports of a process, from threads at once.
# Reading a module's names is slowed down, so that the threads meet inside it.
THREADS = """
import json, threading, time

import equinox as eqx
import jax, jax.numpy as jnp
import filterjit
from filterjit._export import _names

referable = _names._referable

def slow_referable(value):
    time.sleep(1e-4)
    return referable(value)

_names._referable = slow_referable
activations = [
    jax.nn.relu, jax.nn.tanh, jax.nn.gelu, jax.nn.sigmoid, jax.nn.softplus,
    jax.nn.silu, jax.nn.elu, jax.nn.selu, jax.nn.celu, jax.nn.swish,
    jax.nn.log_sigmoid, jax.nn.soft_sign,
]
barrier = threading.Barrier(len(activations))
failures = []

def export(activation):
    model = eqx.nn.MLP(2, 2, 4, 1, activation=activation, key=jax.random.key(0))
    barrier.wait()
    try:
        served = filterjit.export(lambda m, x: jax.vmap(m)(x))
        served(model, jnp.ones((3, 2))).serialize()
    except Exception as error:
        failures.append(f"{type(error).__name__}: {error}")

threads = [threading.Thread(target=export, args=(a,)) for a in activations]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps(failures))
"""


def _first_exports() -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", THREADS],
        capture_output=True,
        text=True,
        env=subprocess_env(TESTS, XLA_PYTHON_CLIENT_PREALLOCATE="false"),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_first_exports_from_threads_at_once() -> None:
    # Each process's first exports, twelve at once behind a barrier; repeated, as a
    # race shows in some processes only.
    for _ in range(2):
        assert _first_exports() == []
