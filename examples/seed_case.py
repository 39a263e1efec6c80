"""The three ways a nested `jax.jit` changes a program, each fixed by filterjit.

A helper receives a value its caller knows at trace time (here a NumPy integer, as
read from a config file or computed with NumPy) inside the caller's `jax.jit`.
Undecorated, the helper sees the value itself. Decorated with `jax.jit` or
`equinox.filter_jit`, it sees a tracer, and:

1. code that ran now raises: `jnp.zeros(n)` needs a concrete `n`;
2. backprop breaks: `fori_loop` with a traced bound is a `while_loop`, which
   reverse-mode cannot differentiate;
3. specialisation is lost: a helper that unrolls a loop when it knows the count, and
   falls back to a `while_loop` when it does not, always falls back.

Decorated with `filterjit.filter_jit`, the helper sees what the undecorated helper
sees, and the program is the same as without the decorator.

    python examples/seed_case.py
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import Tracer

import filterjit


n = np.int32(3)  # known at trace time


def zeros(n: Any) -> jax.Array:
    return jnp.zeros(n)


def count_up(init: Any, lower: Any) -> jax.Array:
    return lax.fori_loop(lower, 1, lambda _, y: y + 1, init)


def power(x: jax.Array, n: Any) -> jax.Array:
    if isinstance(n, Tracer):  # generic: a loop whose length is known at run time
        return lax.fori_loop(0, n - 1, lambda _, y: y * x, x)
    y = x
    for _ in range(n - 1):  # specialised: n - 1 multiplications, unrolled
        y = y * x
    return y


def now_raises(helper: Callable[..., Any]) -> str:
    return f"{jax.jit(lambda: helper(n))()}"


def backprop_breaks(helper: Callable[..., Any]) -> str:
    return f"{jax.jit(lambda: jax.grad(helper)(0.0, np.int32(0)))()}"


def specialisation_lost(helper: Callable[..., Any]) -> str:
    x = jnp.float32(2.0)
    value = jax.jit(lambda x: helper(x, n))(x)
    jaxpr = str(jax.make_jaxpr(lambda x: helper(x, n))(x))
    return f"{value}, {'as a while_loop' if 'while' in jaxpr else 'unrolled'}"


CASES: list[tuple[str, Callable[..., Any], Callable[[Callable[..., Any]], str]]] = [
    ("1. code that ran now raises: jnp.zeros(n)", zeros, now_raises),
    (
        "2. backprop breaks: jax.grad of fori_loop(lower, 1, ...)",
        count_up,
        backprop_breaks,
    ),
    (
        "3. specialisation lost: x**n, unrolled if n is known",
        power,
        specialisation_lost,
    ),
]

DECORATORS: list[tuple[str, Callable[[Any], Any]]] = [
    ("undecorated", lambda f: f),
    ("jax.jit", jax.jit),
    ("equinox.filter_jit", eqx.filter_jit),
    ("filterjit.filter_jit", filterjit.filter_jit),
]


def main() -> None:
    print(f"Each helper is called inside jax.jit with n = {n!r}.\n")
    same = {name: 0 for name, _ in DECORATORS}
    for title, body, case in CASES:
        print(title)
        reference = case(body)
        for name, decorate in DECORATORS:
            try:
                outcome = case(decorate(body))
            except Exception as error:
                message = f"{type(error).__name__}: {str(error).splitlines()[0]}"
                outcome = message[:72] + "..."
            if outcome == reference:
                same[name] += 1
            print(f"   {name:21} {outcome}")
        print()
    print("Same program as undecorated:")
    for name, count in same.items():
        print(f"   {name:21} {count} of {len(CASES)}")


if __name__ == "__main__":
    main()
