"""Node types of the arguments and outputs that tests/test_export.py saves, which the
process that loads them imports and registers itself (loading never imports)."""

import enum
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp


class Scale(eqx.Module):
    """A Module with a static field, called on one example (vmapped over a batch)."""

    weight: jax.Array
    power: int = eqx.field(static=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.weight * x**self.power


class Affine(eqx.Module):
    weight: jax.Array
    bias: jax.Array
    activation: str = eqx.field(static=True)

    def apply(self, x: jax.Array) -> jax.Array:
        y = x @ self.weight + self.bias
        return jnp.tanh(y) if self.activation == "tanh" else y


class Pair(NamedTuple):
    first: Any  # an array (a jax.ShapeDtypeStruct where exported)
    second: int


class Mode(enum.Enum):
    """An enum static: saved by member name once registered."""

    TRAIN = "train"
    SERVE = "serve"


class Net(eqx.Module):
    """A class of the same name as one saved from a script (`__main__.Net`)."""

    weight: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.weight * x
