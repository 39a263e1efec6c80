"""Asynchronous dispatch: does a top-level call return before its result is ready?"""

import statistics
import time
from collections.abc import Callable
from typing import Any

import _harness as harness
import equinox as eqx
import jax
import jax.numpy as jnp

import filterjit


LIMIT = 0.1  # filterjit return ÷ ready
WORK_S = 15e-3
PAUSE_S = 5e-3
STEPS = 8


def work(x: jax.Array, steps: int) -> jax.Array:
    # Unrolled, with no loop in the program: on a GPU, XLA reads a while loop's
    # condition back on the host every step, and the call would wait for it.
    y = x
    for _ in range(steps):
        y = jnp.tanh(y @ x) * 0.5
    return y


def _matrix(size: int) -> jax.Array:
    key = jax.random.key(0)
    return jax.random.normal(key, (size, size), dtype=jnp.float32) / size


def _ready_time(fun: Callable[..., Any], x: jax.Array, steps: int) -> float:
    harness.block(fun(x, steps))  # compile
    times = []
    for _ in range(3):
        start = time.perf_counter_ns()
        harness.block(fun(x, steps))
        times.append((time.perf_counter_ns() - start) * 1e-9)
    return min(times)


def _calibrate() -> tuple[jax.Array, float]:
    """A matrix whose `STEPS` products take about `WORK_S` under jax.jit, on any
    backend (the work grows as the cube of its size)."""
    fun = jax.jit(work, static_argnums=1)
    size = 128
    for _ in range(4):
        seconds = _ready_time(fun, _matrix(size), STEPS)
        size = max(16, round(size * (WORK_S / seconds) ** (1 / 3) / 16) * 16)
    x = _matrix(size)
    return x, _ready_time(fun, x, STEPS)


def _case(
    fun: Callable[..., Any], x: jax.Array, steps: int, times: list[tuple[float, float]]
) -> Callable[[], float]:
    def case() -> float:
        # Start every call from an idle process, as a training loop that does
        # other work between steps would.
        time.sleep(PAUSE_S)
        start = time.perf_counter_ns()
        out = fun(x, steps)
        returned = time.perf_counter_ns()
        harness.block(out)
        ready = time.perf_counter_ns()
        times.append(((returned - start) * 1e-9, (ready - start) * 1e-9))
        return (returned - start) / (ready - start)

    return case


def run(settings: harness.Settings) -> harness.Section:
    x, seconds = _calibrate()
    steps, size = STEPS, x.shape[0]
    impls: dict[str, Callable[..., Any]] = {
        harness.JAX: jax.jit(work, static_argnums=1),
        harness.EQX: eqx.filter_jit(work),
        harness.FILTERJIT: filterjit.filter_jit(work),
    }
    for fun in impls.values():  # compile
        harness.block(fun(x, steps))
    rounds = settings.pick(full=31, quick=3)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in impls}
    cases = {name: _case(fun, x, steps, times[name]) for name, fun in impls.items()}
    medians = harness.interleave(cases, rounds)

    headers = ["implementation", "returns (ms)", "ready (ms)", "return ÷ ready"]
    if settings.targets:
        headers += ["target", "result"]
    rows = []
    targets = []
    for name in impls:
        returned = statistics.median(t for t, _ in times[name]) * 1e3
        ready = statistics.median(t for _, t in times[name]) * 1e3
        row = [
            name,
            harness.fmt_number(returned),
            harness.fmt_number(ready),
            harness.fmt_number(medians[name]),
        ]
        if settings.targets:
            if name == harness.FILTERJIT:
                target = harness.Target("async", "return ÷ ready", medians[name], LIMIT)
                targets.append(target)
                row += [target.describe(), target.verdict]
            else:
                row += ["", ""]
        rows.append(row)
    header = (
        "Time until a top-level call returns, divided by the time until its "
        f"result is ready (median of {rounds} interleaved rounds), for "
        f"{steps} steps of `tanh(y @ x) * 0.5` on float32[{size}, {size}] unrolled "
        f"(`steps` static; the size chosen for this backend): {seconds * 1e3:.1f} ms "
        f"of work under jax.jit. Each call follows a {PAUSE_S * 1e3:.0f} ms pause. "
        "Near 0: the call returns at once and the work runs asynchronously. "
        "Near 1: the call blocks until the result is ready."
    )
    return harness.Section(
        "async", header, harness.markdown_table(headers, rows), targets
    )
