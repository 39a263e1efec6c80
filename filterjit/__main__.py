"""`python -m filterjit`: the three ways a nested jit changes a program, side by side.
Each case calls a helper with a NumPy scalar inside an outer `jax.jit`, where it is
known at trace time; traced by a nested `jax.jit` or `equinox.filter_jit`, it fails
`jnp.zeros(n)`, makes a `fori_loop` a `while_loop` (not reverse-differentiable),
and cannot unroll `range(n)`."""

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._jit import filter_jit


Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def _power(x: jax.Array, n: Any) -> jax.Array:
    y = x
    for _ in range(n - 1):
        y = y * x
    return y


def _count_up(init: Any, lower: Any) -> jax.Array:
    return lax.fori_loop(lower, 1, lambda _, y: y + 1, init)


CASES: tuple[tuple[str, Callable[[Decorator], Any]], ...] = (
    (
        "1. code that ran now raises: jnp.zeros(n), n = np.int32(2), inside jax.jit",
        lambda jit: jax.jit(lambda: jit(lambda n: jnp.zeros(n))(np.int32(2)))(),
    ),
    (
        "2. backprop breaks: jax.jit(lambda: jax.grad(f)(0.0, np.int32(0)))(), "
        "f = fori_loop(lower, 1, ...)",
        lambda jit: jax.jit(lambda: jax.grad(jit(_count_up))(0.0, np.int32(0)))(),
    ),
    (
        "3. a loop no longer unrolls: x**3 as `for _ in range(n - 1)`, "
        "n = np.int32(3), inside jax.jit",
        lambda jit: jax.jit(lambda x: jit(_power)(x, np.int32(3)))(jnp.asarray(2.0)),
    ),
)
DECORATORS: tuple[tuple[str, Decorator], ...] = (
    ("undecorated", lambda f: f),
    ("jax.jit", jax.jit),
    ("equinox.filter_jit", eqx.filter_jit),
    ("filterjit.filter_jit", filter_jit),
)


def main(argv: Sequence[str] | None = None) -> None:
    """Runs every case under every decorator and prints the outcomes; with `--help`
    (or `-h`), prints the usage instead."""
    parser = argparse.ArgumentParser(
        prog="python -m filterjit",
        description=(
            "Shows the three ways a nested jit changes a program: each case calls "
            "a helper with a NumPy scalar inside an outer jax.jit, undecorated and "
            "decorated with jax.jit, equinox.filter_jit and filterjit.filter_jit, "
            "and prints what each gives."
        ),
        epilog="Takes no arguments: run it as `python -m filterjit`.",
    )
    parser.parse_args(argv)  # exits after printing the usage, or for a bad one
    width = max(len(name) for name, _ in DECORATORS)
    for title, case in CASES:
        print(title)
        for name, decorator in DECORATORS:
            try:
                outcome = "ok    " + np.array2string(np.asarray(case(decorator)))
            except Exception as error:
                first = (str(error).strip().splitlines() or [""])[0]
                failed = f"FAIL  {type(error).__name__}: {first}"
                outcome = failed if len(failed) <= 96 else failed[:93] + "..."
            print(f"    {name:<{width}}  {outcome}")
        print()


if __name__ == "__main__":
    main()
