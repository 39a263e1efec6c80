"""Real programs at the top level: a training step that returns its model and
optimiser state, a function with a static leaf in its output, and a library that
wraps a function anew on every call."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _harness import (
    block,
    EQX,
    FILTERJIT,
    fmt_number,
    fmt_ratio,
    interleave,
    JAX,
    markdown_table,
    Section,
    Settings,
    Target,
    time_batch,
)

import filterjit


# filterjit ÷ jax.jit, per program.
LIMITS = {"training step": 1.15, "static output": 1.3, "fresh wrapper": 3.0}


def _training_step() -> dict[str, Callable[[], Any]]:
    """`eqx.nn.MLP` and `optax.adam`: `(model, opt_state, x, y) -> (model,
    opt_state, loss)`. jax.jit is given the model's arrays, partitioned by hand,
    and combines them with its static part inside; the optimiser is closed over."""
    model = eqx.nn.MLP(16, 16, 64, 2, key=jax.random.key(0))
    optimiser = optax.adam(1e-3)
    opt_state = optimiser.init(eqx.filter(model, eqx.is_array))
    x = jnp.ones((32, 16))
    y = jnp.zeros((32, 16))

    def step(model: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        def loss_fn(model: Any) -> jax.Array:
            return jnp.mean((jax.vmap(model)(x) - y) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optimiser.update(
            grads, opt_state, eqx.filter(model, eqx.is_array)
        )
        return eqx.apply_updates(model, updates), opt_state, loss

    params, static = eqx.partition(model, eqx.is_array)

    @jax.jit
    def jax_step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        model, opt_state, loss = step(eqx.combine(params, static), opt_state, x, y)
        return eqx.filter(model, eqx.is_array), opt_state, loss

    eqx_step = eqx.filter_jit(step)
    filterjit_step = filterjit.filter_jit(step)
    return {
        JAX: lambda: jax_step(params, opt_state, x, y),
        EQX: lambda: eqx_step(model, opt_state, x, y),
        FILTERJIT: lambda: filterjit_step(model, opt_state, x, y),
    }


def _static_output() -> dict[str, Callable[[], Any]]:
    """`x -> (x + 1, 3)`. jax.jit returns the 3 as an array."""

    def with_static(x: jax.Array) -> tuple[jax.Array, int]:
        return x + 1, 3

    jax_fun = jax.jit(with_static)
    eqx_fun = eqx.filter_jit(with_static)
    filterjit_fun = filterjit.filter_jit(with_static)
    x = jnp.ones(4)
    return {
        JAX: lambda: jax_fun(x),
        EQX: lambda: eqx_fun(x),
        FILTERJIT: lambda: filterjit_fun(x),
    }


def scale(x: jax.Array, n: int) -> jax.Array:
    return x * n


def _fresh_wrapper() -> dict[str, Callable[[], Any]]:
    """A library that wraps a function anew on each call: `jit(scale)(x, 20)`."""
    x = jnp.ones(4)
    return {
        JAX: lambda: jax.jit(scale, static_argnums=1)(x, 20),
        EQX: lambda: eqx.filter_jit(scale)(x, 20),
        FILTERJIT: lambda: filterjit.filter_jit(scale)(x, 20),
    }


PROGRAMS = {
    "training step": _training_step,
    "static output": _static_output,
    "fresh wrapper": _fresh_wrapper,
}


def run(settings: Settings) -> Section:
    rounds = settings.pick(full=31, quick=3)
    names = [JAX, EQX, FILTERJIT]
    headers = ["program", *(f"{name} (µs)" for name in names)]
    headers += [f"{name} ÷ jax.jit" for name in names[1:]]
    if settings.targets:
        headers += ["target", "result"]
    rows = []
    targets = []
    for program, make in PROGRAMS.items():
        calls = settings.pick(full=200, quick=4)
        impls = make()
        for call in impls.values():  # compile
            block(call())
        medians = interleave(
            {name: time_batch(impls[name], calls) for name in names}, rounds
        )
        us = {name: medians[name] * 1e6 for name in names}
        row = [program, *(fmt_number(us[name]) for name in names)]
        row += [fmt_ratio(us[name], us[JAX]) for name in names[1:]]
        if settings.targets:
            value = us[FILTERJIT] / us[JAX]
            target = Target("programs", program, value, LIMITS[program], "×")
            targets.append(target)
            row += [target.describe(), target.verdict]
        rows.append(row)
    header = (
        "Median µs per top-level call of three real programs, each implementation "
        "in the same interleaved rounds "
        f"({rounds} rounds of {settings.pick(full=200, quick=4)} calls). Training "
        "step: an `eqx.nn.MLP` (16 -> 64 -> 64 -> 16) and `optax.adam` on a batch "
        "of 32, returning `(model, opt_state, loss)`; jax.jit is given the model's "
        "arrays partitioned by hand. Static output: `x -> (x + 1, 3)` (jax.jit "
        "returns the 3 as an array, in its C++ fast path). Fresh wrapper: "
        "`jit(scale)(x, 20)`, the wrapper made anew on every call, as libraries do."
    )
    return Section("programs", header, markdown_table(headers, rows), targets)
