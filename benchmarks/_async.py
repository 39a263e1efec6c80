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
SIZE = 256


def work(x: jax.Array, steps: int) -> jax.Array:
    def body(_: Any, y: jax.Array) -> jax.Array:
        return jnp.tanh(y @ x) * 0.5

    return jax.lax.fori_loop(0, steps, body, x)


def _ready_time(fun: Callable[..., Any], x: jax.Array, steps: int) -> float:
    harness.block(fun(x, steps))  # compile
    times = []
    for _ in range(3):
        start = time.perf_counter_ns()
        harness.block(fun(x, steps))
        times.append((time.perf_counter_ns() - start) * 1e-9)
    return min(times)


def _calibrate(x: jax.Array) -> tuple[int, float]:
    """The number of steps that takes about `WORK_S` under jax.jit."""
    fun = jax.jit(work, static_argnums=1)
    steps = 4
    for _ in range(2):  # compile time aside, the work is close to linear in steps
        seconds = _ready_time(fun, x, steps)
        steps = max(1, round(steps * WORK_S / seconds))
    return steps, _ready_time(fun, x, steps)


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
    x = jax.random.normal(jax.random.key(0), (SIZE, SIZE), dtype=jnp.float32) / SIZE
    steps, seconds = _calibrate(x)
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
        f"{steps} steps of `tanh(y @ x) * 0.5` on float32[{SIZE}, {SIZE}] in a "
        f"`fori_loop`, with `steps` static: {seconds * 1e3:.1f} ms of work under "
        f"jax.jit. Each call follows a {PAUSE_S * 1e3:.0f} ms pause. Near 0: the "
        "call returns at once and the work runs asynchronously. Near 1: the call "
        "blocks until the result is ready."
    )
    return harness.Section(
        "async", header, harness.markdown_table(headers, rows), targets
    )
