"""Tracing an outer function that makes many nested calls."""

import time
from collections.abc import Callable
from typing import Any

import _harness as harness
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import filterjit


LIMIT = 1.0  # filterjit ÷ nested jax.jit
CALLS = 100
STEPS = 10
WIDTH = 16


def inner(x: jax.Array, steps: int, c: np.ndarray) -> jax.Array:
    for _ in range(steps):
        x = jnp.sin(x) * c + x
    return x


def _outer(helper: Callable[..., jax.Array], c: np.ndarray) -> Callable[..., Any]:
    def outer(x: jax.Array) -> jax.Array:
        for _ in range(CALLS):
            x = helper(x, STEPS, c)
        return x

    return outer


def _trace_time(
    helper: Callable[..., Any], c: np.ndarray, x: jax.Array
) -> Callable[[], float]:
    def case() -> float:
        # A fresh outer function every time: make_jaxpr caches its trace on the
        # function object.
        outer = _outer(helper, c)
        start = time.perf_counter_ns()
        jax.make_jaxpr(outer)(x)
        return (time.perf_counter_ns() - start) * 1e-9

    return case


def run(settings: harness.Settings) -> harness.Section:
    c = np.linspace(0.0, 1.0, WIDTH, dtype=np.float32)
    x = jnp.ones((WIDTH,), dtype=jnp.float32)
    # Each decorator is applied once, here; the outer function is made and traced
    # afresh on every measurement.
    helpers: dict[str, Callable[..., Any]] = {
        harness.UNDECORATED: inner,
        harness.JAX: jax.jit(inner, static_argnums=1),
        harness.EQX: eqx.filter_jit(inner),
    }
    nnx = harness.optional_nnx()
    if nnx is not None:
        helpers[harness.NNX] = nnx.jit(inner, static_argnums=1)
    helpers[harness.FILTERJIT] = filterjit.filter_jit(inner)
    cases = {}
    for name, helper in helpers.items():
        cases[name] = case = _trace_time(helper, c, x)
        case()  # warm: the inner trace is cached after this
    rounds = settings.pick(full=15, quick=2)
    medians = harness.interleave(cases, rounds)

    names = [
        harness.UNDECORATED,
        harness.JAX,
        harness.EQX,
        harness.NNX,
        harness.FILTERJIT,
    ]
    ms = {name: None if name not in medians else medians[name] * 1e3 for name in names}
    headers = ["trace", *(f"{name} (ms)" for name in names)]
    headers += [
        f"{name} ÷ jax.jit" for name in (harness.EQX, harness.NNX, harness.FILTERJIT)
    ]
    headers += ["filterjit ÷ undecorated"]
    row = [f"{CALLS} nested calls", *(harness.fmt_number(ms[name]) for name in names)]
    row += [
        harness.fmt_ratio(ms[name], ms[harness.JAX])
        for name in (harness.EQX, harness.NNX, harness.FILTERJIT)
    ]
    row += [harness.fmt_ratio(ms[harness.FILTERJIT], ms[harness.UNDECORATED])]
    targets = []
    if settings.targets:
        value = medians[harness.FILTERJIT] / medians[harness.JAX]
        target = harness.Target("nested", "trace", value, LIMIT, "×")
        targets.append(target)
        headers += ["target", "result"]
        row += [target.describe(), target.verdict]
    header = (
        f"Median ms to trace (`jax.make_jaxpr`) an outer function that calls a "
        f"helper {CALLS} times; the helper takes a float32[{WIDTH}] tracer, a "
        f"static Python int (`static_argnums=1` for jax.jit and nnx.jit) and a "
        f"NumPy float32[{WIDTH}] constant, and runs {STEPS} `sin`/`mul`/`add` "
        "steps. Each decorator is applied once, outside the outer function, and "
        f"every implementation is traced once before timing (warm). {rounds} "
        "interleaved rounds."
    )
    notes = [] if harness.NNX in helpers else [harness.NO_FLAX]
    return harness.Section(
        "nested", header, harness.markdown_table(headers, [row]), targets, notes
    )
