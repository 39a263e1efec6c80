"""Top-level dispatch: `tree -> tree + k` with N array leaves and a static `k`."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from _harness import (
    block,
    EQX,
    FILTERJIT,
    FILTERJIT_JIT,
    fmt_number,
    fmt_ratio,
    interleave,
    JAX,
    markdown_table,
    NNX,
    NO_FLAX,
    optional_nnx,
    RatioRow,
    Section,
    Settings,
    Target,
    time_batch,
)

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
        JAX: jax.jit(add, static_argnums=1),
        EQX: eqx.filter_jit(add),
    }
    nnx = optional_nnx()
    if nnx is not None:
        impls[NNX] = nnx.jit(add, static_argnums=1)
    impls[FILTERJIT] = filterjit.filter_jit(add)
    impls[FILTERJIT_JIT] = filterjit.jit(add, static_argnums=1)
    return impls


def run(settings: Settings) -> Section:
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
            block(fun(tree, k))
        cases = {
            name: time_batch(lambda fun=fun: fun(tree, k), calls)
            for name, fun in impls.items()
        }
        medians[n] = interleave(cases, rounds)

    names = [JAX, EQX, NNX, FILTERJIT, FILTERJIT_JIT]
    headers = ["N", *(f"{name} (µs)" for name in names)]
    headers += [f"{name} ÷ jax.jit" for name in names[1:]]
    if settings.targets:
        headers += ["target", "result", f"{FILTERJIT_JIT} target", "result"]
    rows = []
    targets = []
    ratios = []
    for n in SIZES:
        us = {
            name: medians[n][name] * 1e6 if name in medians[n] else None
            for name in names
        }
        row = [str(n), *(fmt_number(us[name]) for name in names)]
        row += [fmt_ratio(us[name], us[JAX]) for name in names[1:]]
        ratios.append(
            RatioRow(
                f"N={n}",
                {name: medians[n][name] / medians[n][JAX] for name in medians[n]},
                LIMITS[n],
            )
        )
        if settings.targets:
            for name, limits in ((FILTERJIT, LIMITS), (FILTERJIT_JIT, JIT_LIMITS)):
                if n not in limits:
                    row += ["", ""]
                    continue
                value = medians[n][name] / medians[n][JAX]
                label = f"N={n}" if name == FILTERJIT else f"{name} N={n}"
                target = Target("dispatch", label, value, limits[n], "×")
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
    notes = [] if NNX in impls else [NO_FLAX]
    table = markdown_table(headers, rows)
    return Section("dispatch", header, table, targets, notes, ratios)
