"""A library helper that specialises on values known at trace time.

`integrate` steps an ODE with one of eight explicit Runge-Kutta methods. When the
method is known at trace time (a Python int, or a NumPy integer from a config file),
it emits only that method's stages. When the method is a tracer, it has to emit a
`lax.switch` over all eight. Likewise a concrete step count gives a `fori_loop` that
lowers to a `scan`, which reverse-mode differentiates; a traced one gives a
`while_loop`, which it does not.

The helper is decorated once, by the library author, and called by users inside
their own `jax.jit`. Decorated with `filterjit.filter_jit`, it sees what the caller
knows; with `jax.jit` or `equinox.filter_jit`, it sees tracers.

    python examples/library_author.py [--rounds 9]
"""

import argparse
import functools as ft
import statistics
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import Tracer

import filterjit


# Butcher tableaux (a, b) of explicit Runge-Kutta methods.
TABLEAUX: dict[str, tuple[list[list[float]], list[float]]] = {
    "euler": ([[0]], [1]),
    "midpoint": ([[0, 0], [1 / 2, 0]], [0, 1]),
    "heun": ([[0, 0], [1, 0]], [1 / 2, 1 / 2]),
    "ralston": ([[0, 0], [2 / 3, 0]], [1 / 4, 3 / 4]),
    "kutta3": ([[0, 0, 0], [1 / 2, 0, 0], [-1, 2, 0]], [1 / 6, 2 / 3, 1 / 6]),
    "ssprk3": ([[0, 0, 0], [1, 0, 0], [1 / 4, 1 / 4, 0]], [1 / 6, 1 / 6, 2 / 3]),
    "rk4": (
        [[0, 0, 0, 0], [1 / 2, 0, 0, 0], [0, 1 / 2, 0, 0], [0, 0, 1, 0]],
        [1 / 6, 1 / 3, 1 / 3, 1 / 6],
    ),
    "rk38": (
        [[0, 0, 0, 0], [1 / 3, 0, 0, 0], [-1 / 3, 1, 0, 0], [1, -1, 1, 0]],
        [1 / 8, 3 / 8, 3 / 8, 1 / 8],
    ),
}
METHODS = tuple(TABLEAUX)


class VectorField(eqx.Module):
    """dy/dt = -y + sum_k c_k sin((k + 1) y) cos(y - k), with learnable c."""

    coeffs: jax.Array

    def __call__(self, y: jax.Array) -> jax.Array:
        out = -y
        for k in range(self.coeffs.shape[0]):
            out = out + self.coeffs[k] * jnp.sin((k + 1) * y) * jnp.cos(y - k)
        return out


def rk_step(field: VectorField, y: jax.Array, dt: Any, method: str) -> jax.Array:
    """One step of `method`. The tableau is Python data, so zero entries emit
    nothing."""
    a, b = TABLEAUX[method]
    stages: list[jax.Array] = []
    for i in range(len(b)):
        y_i = y
        for j in range(i):
            if a[i][j] != 0:
                y_i = y_i + dt * a[i][j] * stages[j]
        stages.append(field(y_i))
    return y + dt * sum(b_i * k for b_i, k in zip(b, stages) if b_i != 0)


paths: list[str] = []  # which branch each trace of `integrate` took


def integrate(
    field: VectorField, y0: jax.Array, t1: float, num_steps: Any, method: Any
) -> jax.Array:
    """The library's function: integrates `field` from 0 to `t1` in `num_steps`
    steps of `METHODS[method]`. Specialises on whatever is known at trace time."""
    dt = t1 / num_steps
    if isinstance(method, Tracer):
        # Known only at run time: compile every method, choose at run time.
        branches = [ft.partial(rk_step, field, dt=dt, method=m) for m in METHODS]

        def step(y: jax.Array) -> jax.Array:
            return lax.switch(method, branches, y)

        paths.append("lax.switch over 8 methods")
    else:
        name = METHODS[int(method)]

        def step(y: jax.Array) -> jax.Array:
            return rk_step(field, y, dt, name)

        paths.append(f"{name} only")
    # A concrete `num_steps` makes this a scan, which reverse-mode can
    # differentiate; a traced one makes it a while_loop, which it cannot.
    return lax.fori_loop(0, num_steps, lambda _, y: step(y), y0)


DECORATORS: dict[str, Callable[[Any], Any]] = {
    "undecorated": lambda f: f,
    "jax.jit": jax.jit,
    "equinox.filter_jit": eqx.filter_jit,
    "filterjit.filter_jit": filterjit.filter_jit,
}

field = VectorField(jnp.linspace(0.1, 0.6, 6))
y0 = jnp.linspace(-1.0, 1.0, 8)
t1 = 1.0
num_steps = np.ceil(t1 / 0.05).astype(np.int32)  # computed with NumPy: concrete


def which_path() -> None:
    print("1. Which code does the helper emit, called inside the user's jax.jit?")
    print(f"   {'':22} {'method = 6 (int)':28} {'method = np.int32(6)'}")
    for name, decorate in DECORATORS.items():
        helper = decorate(integrate)
        row = []
        for method in (6, np.int32(6)):
            paths.clear()
            jax.jit(lambda y0: helper(field, y0, t1, 20, method))(y0)
            row.append(paths[0])
        print(f"   {name:22} {row[0]:28} {row[1]}")
    print()


def backprop() -> None:
    print("2. Gradient of the final state with respect to y0, inside jax.jit,")
    print(f"   with num_steps = {num_steps!r} from NumPy:")
    for name, decorate in DECORATORS.items():
        helper = decorate(integrate)

        def loss(y0: jax.Array) -> jax.Array:
            return jnp.sum(helper(field, y0, t1, num_steps, 6) ** 2)

        try:
            grad = jax.jit(jax.grad(loss))(y0)
            print(f"   {name:22} ok, |grad| = {float(jnp.linalg.norm(grad)):.4f}")
        except ValueError as error:
            print(f"   {name:22} ValueError: {str(error).split(' or ')[0]}")
    print()


def compile_time(rounds: int = 9) -> None:
    print("3. Milliseconds to the first result of the user's jax.jit, with")
    print("   method = np.int32(6): median of", rounds, "rounds, each with a newly")
    print("   defined helper and user function, so that no cache carries over.")
    stages = ("trace", "lower", "compile", "total")
    times: dict[str, list[list[float]]] = {name: [] for name in DECORATORS}
    for _ in range(rounds):
        for name, decorate in DECORATORS.items():
            # New function objects, so that no cache of JAX's carries over.
            helper = decorate(lambda *args: integrate(*args))
            user = jax.jit(lambda y0: helper(field, y0, t1, 20, np.int32(6)))
            start = time.perf_counter()
            traced = user.trace(y0)
            after_trace = time.perf_counter()
            lowered = traced.lower()
            after_lower = time.perf_counter()
            compiled = lowered.compile()
            after_compile = time.perf_counter()
            compiled(y0).block_until_ready()
            end = time.perf_counter()
            times[name].append(
                [
                    after_trace - start,
                    after_lower - after_trace,
                    after_compile - after_lower,
                    end - start,
                ]
            )
    reference = statistics.median(row[3] for row in times["jax.jit"])
    header = "".join(f"{stage:>9}" for stage in stages)
    print(f"   {'':22}{header}  total ÷ jax.jit")
    for name, rows in times.items():
        medians = [statistics.median(row[i] for row in rows) for i in range(4)]
        cells = "".join(f"{m * 1e3:9.1f}" for m in medians)
        print(f"   {name:22}{cells}  {medians[3] / reference:15.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="A library helper that specialises.")
    parser.add_argument("--rounds", type=int, default=9, help="timing rounds")
    rounds = parser.parse_args().rounds
    which_path()
    backprop()
    compile_time(rounds)
