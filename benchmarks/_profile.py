"""Where a top-level filterjit call spends its time: `run.py --profile`."""

import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from _dispatch import add
from _harness import block

import filterjit


def _per_call(fun: Callable[[], Any], calls: int) -> float:
    """Median µs per call over 15 batches."""
    times = []
    for _ in range(15):
        start = time.perf_counter_ns()
        for _ in range(calls):
            out = fun()
        times.append((time.perf_counter_ns() - start) * 1e-3 / calls)
        block(out)  # pyright: ignore[reportPossiblyUnboundVariable]
    return statistics.median(times)


def _own_python(fun: Any, call: Callable[[], Any], calls: int) -> float:
    """Median µs per call of `call` with `fun`'s cached jitted functions swapped
    for a no-op: filterjit's own Python, without JAX's dispatch."""
    entries = fun._dispatcher.entries[0]._values.values()  # a benchmark may look
    saved = [(entry, entry.jitted, entry.with_call) for entry in entries]
    for entry, _, _ in saved:
        entry.jitted = entry.with_call = lambda *dynamic: None
    try:
        return _per_call(call, calls)
    finally:
        for entry, jitted, with_call in saved:
            entry.jitted, entry.with_call = jitted, with_call


def profile(sizes: tuple[int, ...] = (1, 10, 100, 1000), calls: int = 20_000) -> str:
    """For top-level calls of the dispatch section's function: filterjit's time per
    call against jax.jit's, and a cProfile listing of filterjit's calls by time
    spent in each function. The call into the inner `jax.jit` is C++, which
    cProfile does not list: its time shows under filterjit's `__call__`."""
    parts = []
    for n in sizes:
        tree = [jnp.full((4,), float(i), dtype=jnp.float32) for i in range(n)]
        fun = filterjit.filter_jit(add)
        reference = jax.jit(add, static_argnums=1)
        block((fun(tree, 1.0), reference(tree, 1.0)))
        count = max(100, calls // n)
        ours = _per_call(lambda: fun(tree, 1.0), max(10, count // 15))
        theirs = _per_call(lambda: reference(tree, 1.0), max(10, count // 15))
        own = _own_python(fun, lambda: fun(tree, 1.0), max(10, count // 15))
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(count):
            out = fun(tree, 1.0)
        profiler.disable()
        block(out)  # pyright: ignore[reportPossiblyUnboundVariable]
        stream = io.StringIO()
        stats = pstats.Stats(profiler, stream=stream)
        stats.strip_dirs().sort_stats("tottime").print_stats(15)
        listing = stream.getvalue().strip()
        parts.append(
            f"### N={n}\n\nPer call: filterjit {ours:.2f} µs, jax.jit {theirs:.2f} "
            f"µs, difference {ours - theirs:.2f} µs; filterjit's own Python "
            f"{own:.2f} µs (its jitted function swapped for a no-op). cProfile of "
            f"{count} calls:"
            f"\n\n```\n{listing}\n```"
        )
    header = (
        "## profile\n\nTop-level filterjit calls of `tree -> tree + k` (the "
        f"dispatch section), jax {jax.__version__}. cProfile inflates Python-level "
        "costs against C-level ones: read its figures as shares."
    )
    return "\n\n".join([header, *parts])
