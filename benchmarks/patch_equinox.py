"""A library's `eqx.filter_jit` helpers called inside the user's `jax.jit`, under
Equinox and after `filterjit.patch_equinox()`: what works, and how long it takes.

    python benchmarks/patch_equinox.py

Two helpers, as a library would ship them (decorated when it is imported, each
given a count from a config as a NumPy integer):

- `relax(x, n_steps)`: `lax.fori_loop(0, n_steps, ...)`, differentiated by the
  user's `jax.value_and_grad` (jax-ml/jax#9298). Under Equinox, `n_steps` is a
  tracer, the loop a `while_loop`, and reverse-mode differentiation fails.
- `power_apply(a, y, n)`: `a**n @ y`, by repeated squaring when `n` is known (a
  Python loop over its bits) and by `n` matrix-vector products when it is not.

Equinox's wrappers are made first; `patch_equinox()` then replaces them in this
module, as it does for an installed library imported before it.
"""

import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import Tracer

import filterjit


CONFIG = {"n_steps": np.int64(48), "power": np.int64(1000)}


@eqx.filter_jit
def relax(x, n_steps):
    return lax.fori_loop(0, n_steps, lambda _, y: 0.9 * y + 0.1 * jnp.tanh(y), x)


@eqx.filter_jit
def power_apply(a, y, n):
    if isinstance(n, Tracer):  # the count is only known at run time
        return lax.fori_loop(0, n, lambda _, v: a @ v, y)
    n = int(n)
    while n:  # repeated squaring: about 2 log2(n) products
        if n & 1:
            y = a @ y
        a = a @ a
        n >>= 1
    return y


def _loss(w, x):
    return jnp.sum(relax(w * x, CONFIG["n_steps"]) ** 2)


def _train(steps: int) -> tuple[float, float, float]:
    """Seconds per training step, and the loss before and after."""

    @jax.jit
    def step(w, x):
        loss, grad = jax.value_and_grad(_loss)(w, x)
        return loss, w - 0.1 * grad

    w, x = jnp.ones(16), jnp.linspace(-1.0, 1.0, 16)
    first, w = step(w, x)  # compiles
    w.block_until_ready()
    loss = first
    start = time.perf_counter()
    for _ in range(steps):
        loss, w = step(w, x)
    w.block_until_ready()
    return (time.perf_counter() - start) / steps, float(first), float(loss)


def _power(repeats: int) -> tuple[float, float, jax.Array]:
    a = jnp.eye(32) * 0.999 + 0.001 * jnp.ones((32, 32)) / 32
    y = jnp.ones(32)
    outer = jax.jit(lambda a, y: power_apply(a, y, CONFIG["power"]))
    start = time.perf_counter()
    out = outer(a, y).block_until_ready()
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        outer(a, y).block_until_ready()
        times.append(time.perf_counter() - start)
    return compile_s, float(np.median(times)), out


def _measure(label: str) -> jax.Array:
    try:
        per_step, first, last = _train(200)
        trained = (
            f"trains (loss {first:.4f} -> {last:.4f} in 200 steps), "
            f"{per_step * 1e6:.0f} µs per step"
        )
    except ValueError as error:
        trained = f"fails: {str(error).splitlines()[0]}"
    jax.clear_caches()
    compile_s, run_s, out = _power(200)
    print(f"{label}:")
    print(f"  relax under value_and_grad: {trained}")
    print(
        f"  power_apply(n=1000): first call {compile_s * 1e3:.0f} ms, then "
        f"{run_s * 1e6:.0f} µs per call"
    )
    return out


def main() -> int:
    print(f"jax {jax.__version__}, equinox {eqx.__version__}, {jax.devices()[0]}")
    before = _measure("equinox.filter_jit")
    report = filterjit.patch_equinox()
    here = [name for name in report.swapped if name.startswith(__name__)]
    print(
        f"patch_equinox(): swapped {len(report.swapped)} wrappers ({here}), "
        f"left {len(report.left)}"
    )
    jax.clear_caches()
    after = _measure("after filterjit.patch_equinox()")
    print(f"power_apply results agree: {bool(jnp.allclose(before, after, rtol=1e-4))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
