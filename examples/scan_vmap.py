"""`filter_jit` inside `lax.scan` bodies and under `jax.vmap`.

A scan body is staged, so a decorated helper called there sees its caller's
concrete values unchanged: here a NumPy kernel that the helper normalises with
NumPy at trace time. Under an eager `vmap`, batched arguments are traced and Python
scalars stay static. Each result is compared with the same program undecorated.

    python examples/scan_vmap.py
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import filterjit
from filterjit import filter_jit


KERNEL = np.array([1.0, 2.0, 1.0], np.float32)
traces = {"smooth": 0}


def smooth(x: jax.Array, kernel: Any) -> jax.Array:
    """Convolves with `kernel / kernel.sum()`. The normalisation runs in NumPy, so
    `kernel` must be concrete."""
    traces["smooth"] += 1
    weights = np.asarray(kernel) / np.sum(kernel)
    return jnp.convolve(x, weights, mode="same")


def damp(x: jax.Array, steps: int, rate: float) -> jax.Array:
    """`steps` damped updates, unrolled: `steps` is a Python int."""
    for _ in range(steps):
        x = x - rate * jnp.tanh(x)
    return x


def simulate(smooth_fn: Callable[..., Any], x0: jax.Array) -> tuple[Any, Any]:
    def body(x: jax.Array, _: None) -> tuple[jax.Array, jax.Array]:
        x = smooth_fn(x, KERNEL)
        return x, x.max()

    return lax.scan(body, x0, length=20)


def compare(label: str, decorated: Any, undecorated: Any) -> None:
    """Prints how far apart two results are, in float32 units in the last place
    (ulps) of the undecorated result: 0 is bit-for-bit equal, 1 is the rounding by
    which a compiled program may differ from the same operations run one by one."""
    ulps = 0.0
    for a, b in zip(jax.tree.leaves(decorated), jax.tree.leaves(undecorated)):
        a, b = np.asarray(a), np.asarray(b)
        ulps = max(ulps, float(np.max(np.abs(a - b) / np.spacing(np.abs(b)))))
    print(f"   {label:16} max |decorated - undecorated| = {ulps:.0f} ulp")


def main() -> None:
    x0 = jnp.zeros(16).at[8].set(1.0)
    smooth_jit = filter_jit(smooth)
    damp_jit = filter_jit(damp)
    batched = (0, None, None)  # vmap over x; steps and rate unbatched

    print("1. A decorated helper in a lax.scan body, with a NumPy kernel")
    final, peaks = simulate(smooth_jit, x0)
    traced_once = traces["smooth"]
    print(
        f"   peak after 1, 10, 20 steps: {peaks[0]:.4f} {peaks[9]:.4f} {peaks[19]:.4f}"
    )
    print(f"   Python traces of the decorated helper: {traced_once}")
    compare("scan", (final, peaks), simulate(smooth, x0))
    with_jit = jax.jit(simulate, static_argnums=0)
    compare("jit(scan)", with_jit(smooth_jit, x0), with_jit(smooth, x0))
    try:
        simulate(jax.jit(smooth), x0)
    except jax.errors.TracerArrayConversionError as error:
        print(f"   with jax.jit on the helper instead: {type(error).__name__}")

    print("2. Under vmap: batched arrays traced, Python scalars static")
    xs = jnp.linspace(-2.0, 2.0, 5)
    ys = jax.vmap(damp_jit, in_axes=batched)(xs, 3, 0.5)
    print(f"   {ys}")
    compare("vmap", ys, jax.vmap(damp, in_axes=batched)(xs, 3, 0.5))
    compare(
        "vmap(grad)",
        jax.vmap(jax.grad(damp_jit), in_axes=batched)(xs, 3, 0.5),
        jax.vmap(jax.grad(damp), in_axes=batched)(xs, 3, 0.5),
    )
    print(f"   traces of damp (vmap, vmap(grad)): {filterjit.num_traces(damp_jit)}")
    for shift in (1.0, 2.0, 3.0):  # new values, same shapes: no new trace
        jax.vmap(damp_jit, in_axes=batched)(xs + shift, 3, 0.5)
    print(f"   after three more batches: {filterjit.num_traces(damp_jit)}")

    print("3. vmap inside a scan body inside jax.jit")

    def rollout(damp_fn: Callable[..., Any], xs: jax.Array) -> jax.Array:
        def body(x: jax.Array, _: None) -> tuple[jax.Array, jax.Array]:
            x = jax.vmap(damp_fn, in_axes=batched)(x, 2, 0.1)
            return x, x.mean()

        return lax.scan(body, xs, length=10)[1]

    rollout_jit = jax.jit(rollout, static_argnums=0)
    means = rollout_jit(damp_jit, xs + 1.0)
    print(f"   mean after 1, 2, 3 steps: {means[0]:.4f} {means[1]:.4f} {means[2]:.4f}")
    compare("jit(scan(vmap))", means, rollout_jit(damp, xs + 1.0))


if __name__ == "__main__":
    main()
