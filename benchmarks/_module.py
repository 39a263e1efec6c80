"""A module with ten array fields, a static field and a compiled `__call__`."""

from collections.abc import Callable
from typing import Any

import _harness as harness
import equinox as eqx
import jax
import jax.numpy as jnp

import filterjit


LIMIT = 1.5  # filterjit model(x) ÷ flat jax.jit
JAX_ON_MODULE = "jax.jit on the Module"
FIELDS = 10
WIDTH = 8


def _apply(weights: tuple[jax.Array, ...], scale: float, x: jax.Array) -> jax.Array:
    for w in weights:
        x = jnp.tanh(x * w) * scale
    return x


def flat(
    w0: jax.Array,
    w1: jax.Array,
    w2: jax.Array,
    w3: jax.Array,
    w4: jax.Array,
    w5: jax.Array,
    w6: jax.Array,
    w7: jax.Array,
    w8: jax.Array,
    w9: jax.Array,
    scale: float,
    x: jax.Array,
) -> jax.Array:
    """The same work as the modules' `__call__`, every field passed as an argument."""
    return _apply((w0, w1, w2, w3, w4, w5, w6, w7, w8, w9), scale, x)


class _Fields(eqx.Module):
    w0: jax.Array
    w1: jax.Array
    w2: jax.Array
    w3: jax.Array
    w4: jax.Array
    w5: jax.Array
    w6: jax.Array
    w7: jax.Array
    w8: jax.Array
    w9: jax.Array
    scale: float = eqx.field(static=True)

    def weights(self) -> tuple[jax.Array, ...]:
        return tuple(getattr(self, f"w{i}") for i in range(FIELDS))


class FilterJitModel(_Fields):
    @filterjit.filter_jit
    def __call__(self, x: jax.Array) -> jax.Array:
        return _apply(self.weights(), self.scale, x)


class EqxModel(_Fields):
    @eqx.filter_jit
    def __call__(self, x: jax.Array) -> jax.Array:
        return _apply(self.weights(), self.scale, x)


def _nnx_model(
    weights: list[jax.Array], scale: float
) -> Callable[[jax.Array], Any] | None:
    nnx = harness.optional_nnx()
    if nnx is None:
        return None

    class NnxModel(nnx.Module):
        def __init__(self):
            for i, w in enumerate(weights):
                setattr(self, f"w{i}", nnx.Param(w))
            self.scale = scale

        @nnx.jit
        def __call__(self, x: jax.Array) -> jax.Array:
            params = tuple(getattr(self, f"w{i}")[...] for i in range(FIELDS))
            return _apply(params, self.scale, x)

    return NnxModel()


def run(settings: harness.Settings) -> harness.Section:
    weights = [
        jnp.linspace(0.5, 1.5, WIDTH, dtype=jnp.float32) + i for i in range(FIELDS)
    ]
    scale = 0.5
    x = jnp.ones((WIDTH,), dtype=jnp.float32)
    flat_jit = jax.jit(flat, static_argnums=FIELDS)
    eqx_model = EqxModel(*weights, scale=scale)
    nnx_model = _nnx_model(weights, scale)
    filterjit_model = FilterJitModel(*weights, scale=scale)
    # Not a column: jax.jit given the Module itself, which JAX's flatten takes
    # apart with Equinox's code on every call (filterjit reads its fields).
    module_jit = jax.jit(lambda model, x: _apply(model.weights(), model.scale, x))
    plain_model = _Fields(*weights, scale=scale)
    calls: dict[str, Callable[[], Any]] = {
        harness.JAX: lambda: flat_jit(*weights, scale, x),
        JAX_ON_MODULE: lambda: module_jit(plain_model, x),
        harness.EQX: lambda: eqx_model(x),
    }
    if nnx_model is not None:
        calls[harness.NNX] = lambda: nnx_model(x)
    calls[harness.FILTERJIT] = lambda: filterjit_model(x)
    for call in calls.values():  # compile
        harness.block(call())

    rounds = settings.pick(full=41, quick=3)
    batch = settings.pick(full=200, quick=5)
    medians = harness.interleave(
        {n: harness.time_batch(c, batch) for n, c in calls.items()}, rounds
    )

    names = [harness.JAX, harness.EQX, harness.NNX, harness.FILTERJIT]
    us = {name: None if name not in medians else medians[name] * 1e6 for name in names}
    headers = ["call", *(f"{name} (µs)" for name in names)]
    headers += [f"{name} ÷ jax.jit" for name in names[1:]]
    row = ["model(x)", *(harness.fmt_number(us[name]) for name in names)]
    row += [harness.fmt_ratio(us[name], us[harness.JAX]) for name in names[1:]]
    targets = []
    if settings.targets:
        value = medians[harness.FILTERJIT] / medians[harness.JAX]
        target = harness.Target("module", "model(x)", value, LIMIT, "×")
        targets.append(target)
        headers += ["target", "result"]
        row += [target.describe(), target.verdict]
    header = (
        f"Median µs per call of `model(x)`: an `eqx.Module` with {FIELDS} float32"
        f"[{WIDTH}] fields, a static float field and a decorated `__call__` "
        "(eqx.filter_jit, filterjit). The jax.jit column is the same work with "
        "every field passed flat, `f(w0, ..., w9, scale, x)` with `scale` in "
        "`static_argnums`; the nnx.jit column is an `nnx.Module` holding the "
        f"weights as `nnx.Param`s with an `@nnx.jit` `__call__`. {rounds} "
        f"interleaved rounds of {batch} calls."
    )
    notes = [
        f"jax.jit given the Module itself (`jax.jit(f)(model, x)`): "
        f"{harness.fmt_number(medians[JAX_ON_MODULE] * 1e6)} µs; filterjit ÷ that: "
        f"{harness.fmt_ratio(medians[harness.FILTERJIT], medians[JAX_ON_MODULE])}×. "
        "jax.jit flattens "
        "the Module with Equinox's code on every call; filterjit reads its fields "
        "where they match the latest call's."
    ]
    if harness.NNX not in calls:
        notes.append(harness.NO_FLAX)
    return harness.Section(
        "module", header, harness.markdown_table(headers, [row]), targets, notes
    )
