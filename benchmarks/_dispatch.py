"""Top-level dispatch: `tree -> tree + k` with N array leaves and a static `k`."""

from collections.abc import Callable
from typing import Any

import _harness as harness
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

import filterjit


SIZES = (1, 10, 100, 1000)
# filterjit ÷ jax.jit, per N.
LIMITS = {1: 1.25, 10: 1.2, 100: 1.1, 1000: 1.1}
# filterjit.jit ÷ jax.jit, per N: jax.jit's object behind a check of the trace level.
JIT_LIMITS = {1: 1.25, 10: 1.1, 100: 1.1, 1000: 1.1}


def add(tree: list[jax.Array], k: float) -> list[jax.Array]:
    return jtu.tree_map(lambda x: x + k, tree)


def _implementations() -> dict[str, Callable[..., Any]]:
    impls: dict[str, Callable[..., Any]] = {
        harness.JAX: jax.jit(add, static_argnums=1),
        harness.EQX: eqx.filter_jit(add),
    }
    nnx = harness.optional_nnx()
    if nnx is not None:
        impls[harness.NNX] = nnx.jit(add, static_argnums=1)
    impls[harness.FILTERJIT] = filterjit.filter_jit(add)
    impls[harness.FILTERJIT_JIT] = filterjit.jit(add, static_argnums=1)
    return impls


def run(settings: harness.Settings) -> harness.Section:
    impls = _implementations()
    rounds = settings.pick(full=41, quick=3)
    medians: dict[int, dict[str, float]] = {}
    batch_sizes: dict[int, int] = {}
    for n in SIZES:
        # Batches of 2000 leaves' worth of calls, and at least 24 calls: a few
        # milliseconds of jax.jit calls or more, long enough that one slow call
        # does not move a batch's figure much.
        calls = settings.pick(full=max(24, 2000 // n), quick=max(2, 40 // n))
        batch_sizes[n] = calls
        tree = [jnp.full((4,), float(i), dtype=jnp.float32) for i in range(n)]
        k = 1.0
        for fun in impls.values():  # compile
            harness.block(fun(tree, k))
        cases = {
            name: harness.time_batch(lambda fun=fun: fun(tree, k), calls)
            for name, fun in impls.items()
        }
        medians[n] = harness.interleave(cases, rounds)

    names = [
        harness.JAX,
        harness.EQX,
        harness.NNX,
        harness.FILTERJIT,
        harness.FILTERJIT_JIT,
    ]
    headers = ["N", *(f"{name} (µs)" for name in names)]
    headers += [f"{name} ÷ jax.jit" for name in names[1:]]
    if settings.targets:
        headers += ["target", "result", f"{harness.FILTERJIT_JIT} target", "result"]
    rows = []
    targets = []
    ratios = []
    for n in SIZES:
        us = {
            name: medians[n][name] * 1e6 if name in medians[n] else None
            for name in names
        }
        row = [str(n), *(harness.fmt_number(us[name]) for name in names)]
        row += [harness.fmt_ratio(us[name], us[harness.JAX]) for name in names[1:]]
        ratios.append(
            harness.RatioRow(
                f"N={n}",
                {
                    name: medians[n][name] / medians[n][harness.JAX]
                    for name in medians[n]
                },
                LIMITS[n],
            )
        )
        if settings.targets:
            for name, limits in (
                (harness.FILTERJIT, LIMITS),
                (harness.FILTERJIT_JIT, JIT_LIMITS),
            ):
                if n not in limits:
                    row += ["", ""]
                    continue
                value = medians[n][name] / medians[n][harness.JAX]
                label = f"N={n}" if name == harness.FILTERJIT else f"{name} N={n}"
                target = harness.Target("dispatch", label, value, limits[n], "×")
                targets.append(target)
                row += [target.describe(), target.verdict]
        rows.append(row)
    batches = ", ".join(f"{calls} at N={n}" for n, calls in batch_sizes.items())
    header = (
        "Median µs per top-level call of `tree -> tree + k`: a list of N float32[4] "
        "arrays and a static Python float `k` (`static_argnums=1` for jax.jit, "
        f"nnx.jit and filterjit.jit). {rounds} interleaved rounds; each round times "
        f"a batch of back-to-back calls ({batches}) of every implementation in "
        "turn, and blocks on the outputs after the clock stops, so the figure is "
        "dispatch, not compute."
    )
    notes = [] if harness.NNX in impls else [harness.NO_FLAX]
    table = harness.markdown_table(headers, rows)
    return harness.Section("dispatch", header, table, targets, notes, ratios)
