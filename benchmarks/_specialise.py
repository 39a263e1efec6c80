"""Compile time of helpers that specialise on a concrete argument.

A helper receives a NumPy integer from its caller (read from a configuration, or
computed with NumPy at trace time), inside an outer `jax.jit`. Undecorated, or
under filterjit, the value is concrete, so the helper can be written naturally:
pick one branch in Python, or unroll a loop of known length. A nested `jax.jit`
or `eqx.filter_jit` turns the value into a tracer, so the same helper has to be
written for a traced value: `lax.switch` over every branch, or `lax.fori_loop`
with a traced trip count. Each implementation runs the body it needs.
"""

import time
from collections.abc import Callable
from typing import Any

import _harness as harness
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import filterjit


BRANCHES = 8
BRANCH_STEPS = 25
LOOP_STEPS = 32
WIDTH = 64

Helper = Callable[[jax.Array, Any], jax.Array]


def _branch_helpers() -> tuple[Helper, Helper]:
    """(natural, generic) bodies that run one of `BRANCHES` solvers. Made afresh on
    every call, so that no JAX cache keyed on the function carries over."""

    def make_solver(k: int) -> Callable[[jax.Array], jax.Array]:
        def solver(x: jax.Array) -> jax.Array:
            for i in range(BRANCH_STEPS):
                x = jnp.sin(x * (k + 1)) + jnp.cos(x) * (i / BRANCH_STEPS)
            return x

        return solver

    solvers = [make_solver(k) for k in range(BRANCHES)]

    def natural(x: jax.Array, method: Any) -> jax.Array:
        return solvers[int(method)](x)

    def generic(x: jax.Array, method: Any) -> jax.Array:
        return jax.lax.switch(method, solvers, x)

    return natural, generic


def _loop_helpers() -> tuple[Helper, Helper]:
    """(natural, generic) bodies of a loop with a step-dependent coefficient."""
    coefficients = np.linspace(0.1, 1.0, LOOP_STEPS, dtype=np.float32)

    def natural(x: jax.Array, steps: Any) -> jax.Array:
        for i in range(int(steps)):
            x = jnp.sin(x) * coefficients[i] + x
        return x

    def generic(x: jax.Array, steps: Any) -> jax.Array:
        table = jnp.asarray(coefficients)
        return jax.lax.fori_loop(0, steps, lambda i, y: jnp.sin(y) * table[i] + y, x)

    return natural, generic


CASES: dict[str, tuple[Callable[[], tuple[Helper, Helper]], Any, str]] = {
    "branch": (
        _branch_helpers,
        np.int32(5),
        f"one of {BRANCHES} solvers of {BRANCH_STEPS} steps: Python indexing vs "
        "`lax.switch`",
    ),
    "loop": (
        _loop_helpers,
        np.int32(LOOP_STEPS),
        f"{LOOP_STEPS} steps: Python loop, unrolled, vs `lax.fori_loop` with a "
        "traced trip count",
    ),
}


def _decorate(name: str, natural: Helper, generic: Helper) -> Helper:
    if name == harness.UNDECORATED:
        return natural
    if name == harness.FILTERJIT:
        return filterjit.filter_jit(natural)
    if name == harness.JAX:
        return jax.jit(generic)
    if name == harness.EQX:
        return eqx.filter_jit(generic)
    raise ValueError(name)


def _case(
    name: str, make: Callable[[], tuple[Helper, Helper]], value: Any, x: jax.Array
) -> Callable[[], float]:
    def case() -> float:
        helper = _decorate(name, *make())
        outer = jax.jit(lambda y: helper(y, value))
        start = time.perf_counter_ns()
        harness.block(outer(x))
        return (time.perf_counter_ns() - start) * 1e-9

    return case


def run(settings: harness.Settings) -> harness.Section:
    x = jnp.linspace(-1.0, 1.0, WIDTH, dtype=jnp.float32)
    names = [harness.UNDECORATED, harness.JAX, harness.EQX, harness.FILTERJIT]
    rounds = settings.pick(full=9, quick=1)
    # Check once that both bodies compute the same thing.
    for make, value, _ in CASES.values():
        natural, generic = make()
        np.testing.assert_allclose(
            jax.jit(lambda y: natural(y, value))(x),
            jax.jit(lambda y: generic(y, value))(x),
            rtol=1e-5,
            atol=1e-5,
        )
    headers = ["case", *(f"{name} (ms)" for name in names)]
    headers += ["filterjit ÷ jax.jit", "filterjit ÷ undecorated"]
    rows = []
    for label, (make, value, _) in CASES.items():
        cases = {name: _case(name, make, value, x) for name in names}
        for case in cases.values():  # warm JAX's own machinery, untimed
            case()
        ms = {name: t * 1e3 for name, t in harness.interleave(cases, rounds).items()}
        row = [label, *(harness.fmt_number(ms[name]) for name in names)]
        row += [harness.fmt_ratio(ms[harness.FILTERJIT], ms[harness.JAX])]
        row += [harness.fmt_ratio(ms[harness.FILTERJIT], ms[harness.UNDECORATED])]
        rows.append(row)
    cases_text = "; ".join(
        f"**{label}**: {text}" for label, (_, _, text) in CASES.items()
    )
    header = (
        "Median ms to compile and first run an outer `jax.jit` whose helper "
        "receives a concrete NumPy integer. Undecorated and under filterjit the "
        "value is concrete and the helper is written naturally; nested jax.jit and "
        "eqx.filter_jit trace it, so their helper has to take the generic path. "
        f"Cases: {cases_text}. Helpers, decorators and the outer function are "
        f"made afresh for every measurement, so no cache carries over; {rounds} "
        "interleaved rounds. No target: this is what keeping values concrete buys "
        "(or costs)."
    )
    return harness.Section(
        "specialisation", header, harness.markdown_table(headers, rows)
    )
