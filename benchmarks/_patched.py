"""A library's `eqx.filter_jit` helpers called inside the user's `jax.jit`, with
Equinox's wrappers and with those `filterjit.patch_equinox()` replaces them by.

Two helpers, as a library ships them (decorated with `eqx.filter_jit` when this
module is imported, each given a count from a config as a NumPy integer):

- `relax(x, n_steps)`: `lax.fori_loop(0, n_steps, ...)`, differentiated by the
  user's `jax.value_and_grad` (jax-ml/jax#9298). Under Equinox, `n_steps` is a
  tracer, the loop a `while_loop`, and reverse-mode differentiation fails.
- `power_apply(a, y, n)`: `a**n @ y`, by repeated squaring when `n` is known (a
  Python loop over its bits) and by `n` matrix-vector products when it is not.

`patch_equinox()` replaces this module's wrappers as it does an installed
library's imported before it. The patch is in force only while the replacements
are read off the module, and `unpatch_equinox()` undoes it at once; both
wrappers are then measured side by side, so that no other section of the run
sees a patched Equinox.
"""

import time
import warnings
from collections.abc import Callable
from typing import Any

import _harness as harness
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import Tracer

import filterjit


PATCHED = "filterjit, patched"
CONFIG = {"n_steps": np.int64(48), "power": np.int64(1000)}
STEPS = 200  # training steps of `relax`: a few ms either way
SIZE = 32
LIMIT = 1.0  # filterjit ÷ eqx.filter_jit, per later call of power_apply


@eqx.filter_jit
def relax(x: jax.Array, n_steps: Any) -> jax.Array:
    return lax.fori_loop(0, n_steps, lambda _, y: 0.9 * y + 0.1 * jnp.tanh(y), x)


@eqx.filter_jit
def power_apply(a: jax.Array, y: jax.Array, n: Any) -> jax.Array:
    if isinstance(n, Tracer):  # the count is only known at run time
        return lax.fori_loop(0, n, lambda _, v: a @ v, y)
    n = int(n)
    while n:  # repeated squaring: about 2 log2(n) products
        if n & 1:
            y = a @ y
        a = a @ a
        n >>= 1
    return y


Helpers = dict[str, Callable[..., jax.Array]]


def _wrappers() -> tuple[dict[str, Helpers], int]:
    """Equinox's wrappers of the two helpers and filterjit's, as
    `patch_equinox()` makes them, and how many wrappers the patch swapped in all.
    Equinox's `filter_jit` is its own again when this returns."""
    equinox = {"relax": relax, "power_apply": power_apply}
    with warnings.catch_warnings():
        # It warns of what it leaves: wrappers other sections hold in closures.
        warnings.simplefilter("ignore")
        report = filterjit.patch_equinox()
    try:
        patched = {name: globals()[name] for name in equinox}
    finally:
        filterjit.unpatch_equinox()
    filterjit_wrapper = type(filterjit.filter_jit(lambda x: x))
    for name, wrapper in patched.items():
        if type(wrapper) is not filterjit_wrapper:
            raise AssertionError(f"patch_equinox() did not replace {name}")
        if globals()[name] is not equinox[name]:
            raise AssertionError(f"unpatch_equinox() did not give {name} back")
    return {harness.EQX: equinox, PATCHED: patched}, len(report.swapped)


def _train(helper: Callable[..., jax.Array]) -> tuple[Callable[[], float] | None, str]:
    """A case: seconds per step of `STEPS` training steps through `relax`, and
    what the first such run did ('trains: loss A → B'); or `None`, and 'fails:'
    with the first sentence of the error."""

    @jax.jit
    def step(w: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        def loss(w: jax.Array) -> jax.Array:
            return jnp.sum(helper(w * x, CONFIG["n_steps"]) ** 2)

        value, grad = jax.value_and_grad(loss)(w)
        return value, w - 0.1 * grad

    x = jnp.linspace(-1.0, 1.0, 16)

    def case() -> float:
        w = jnp.ones(16)
        start = time.perf_counter_ns()
        for _ in range(STEPS):
            _, w = step(w, x)
        harness.block(w)
        return (time.perf_counter_ns() - start) * 1e-9 / STEPS

    try:
        first, w = step(jnp.ones(16), x)  # compiles
    except ValueError as error:
        first_sentence = str(error).split(". ")[0].rstrip(".")
        return None, f"fails: {first_sentence}"
    for _ in range(STEPS - 1):
        _, w = step(w, x)
    last, _ = step(w, x)  # the loss after `STEPS` steps
    return case, f"trains: loss {float(first):.4f} → {float(last):.4f}"


def _inputs() -> tuple[jax.Array, jax.Array]:
    a = jnp.eye(SIZE) * 0.999 + 0.001 * jnp.ones((SIZE, SIZE)) / SIZE
    return a, jnp.ones(SIZE)


def _first_call(helper: Callable[..., jax.Array]) -> Callable[[], float]:
    """A case: seconds to trace, compile and run a fresh outer `jax.jit` of
    `power_apply`, JAX's caches cleared (Equinox's wrapper keeps its inner
    `jax.jit`'s trace there)."""
    a, y = _inputs()

    def case() -> float:
        jax.clear_caches()
        outer = jax.jit(lambda a, y: helper(a, y, CONFIG["power"]))
        start = time.perf_counter_ns()
        harness.block(outer(a, y))
        return (time.perf_counter_ns() - start) * 1e-9

    return case


def _later_call(
    helper: Callable[..., jax.Array], calls: int
) -> tuple[Callable[[], float], jax.Array]:
    """A case: seconds per call of the compiled outer `jax.jit`, each call blocked
    on (the work, not the dispatch, differs); and its result."""
    a, y = _inputs()
    outer = jax.jit(lambda a, y: helper(a, y, CONFIG["power"]))
    out = outer(a, y)
    harness.block(out)

    def case() -> float:
        start = time.perf_counter_ns()
        for _ in range(calls):
            harness.block(outer(a, y))
        return (time.perf_counter_ns() - start) * 1e-9 / calls

    return case, out


def run(settings: harness.Settings) -> harness.Section:
    rounds = settings.pick(full=9, quick=1)
    calls = settings.pick(full=100, quick=10)
    wrappers, swapped = _wrappers()
    names = list(wrappers)
    training = {name: _train(helpers["relax"]) for name, helpers in wrappers.items()}
    trains = {name: text for name, (_, text) in training.items()}
    steps = {name: case for name, (case, _) in training.items() if case is not None}
    step_s = harness.interleave(steps, rounds) if steps else {}  # both may fail
    first_s = harness.interleave(
        {name: _first_call(h["power_apply"]) for name, h in wrappers.items()}, rounds
    )
    later = {name: _later_call(h["power_apply"], calls) for name, h in wrappers.items()}
    np.testing.assert_allclose(later[harness.EQX][1], later[PATCHED][1], rtol=1e-4)
    later_s = harness.interleave(
        {name: case for name, (case, _) in later.items()}, rounds
    )

    def relax_cell(name: str) -> str:
        if name not in step_s:
            return trains[name]
        return f"{trains[name]}, {harness.fmt_number(step_s[name] * 1e6)} µs per step"

    headers = ["helper, inside the user's jax.jit", f"{harness.EQX}", PATCHED]
    headers += [f"{PATCHED} ÷ {harness.EQX}"]
    if settings.targets:
        headers += ["target", "result"]
    n = int(CONFIG["power"])
    rows = [
        ["relax under value_and_grad", *(relax_cell(name) for name in names), "n/a"],
        [
            f"power_apply (n = {n}), first call (ms)",
            *(harness.fmt_number(first_s[name] * 1e3) for name in names),
            harness.fmt_ratio(first_s[PATCHED], first_s[harness.EQX]),
        ],
        [
            f"power_apply (n = {n}), later call (µs)",
            *(harness.fmt_number(later_s[name] * 1e6) for name in names),
            harness.fmt_ratio(later_s[PATCHED], later_s[harness.EQX]),
        ],
    ]
    targets = []
    if settings.targets:
        trained = harness.Target(
            "patched",
            "relax after patch failed (0: trains)",
            float(PATCHED not in step_s),
            0,
        )
        faster = harness.Target(
            "patched",
            "power_apply later call ÷ eqx.filter_jit",
            later_s[PATCHED] / later_s[harness.EQX],
            LIMIT,
            "×",
        )
        targets = [trained, faster]
        rows[0] += ["trains", trained.verdict]
        rows[1] += ["", ""]
        rows[2] += [faster.describe(), faster.verdict]
    header = (
        "Two helpers of a library, decorated with `@eqx.filter_jit` when it is "
        "imported and called inside the user's `jax.jit` with a count from a "
        "config as a NumPy integer: `relax`, a `lax.fori_loop(0, n_steps)` with "
        f"`n_steps = {int(CONFIG['n_steps'])}`, trained under `jax.value_and_grad` "
        f"for {STEPS} steps (jax-ml/jax#9298), and `power_apply`, `a**n @ y` on "
        f"float32[{SIZE}, {SIZE}], by repeated squaring when `n` is concrete and by "
        f"`n` matrix-vector products when it is traced. {harness.EQX}: the helpers as "
        f"decorated; {PATCHED}: the wrappers `filterjit.patch_equinox()` put in "
        f"their place (it swapped {swapped}, these two among them), read off the "
        "module before `filterjit.unpatch_equinox()` undid it, so no other section "
        "runs patched. Medians of "
        f"{rounds} interleaved rounds: per training step; per first call (JAX's "
        "caches cleared, a fresh outer `jax.jit`: trace, compile and run); per "
        f"later call ({calls} calls, each blocked on). Both power_apply results "
        "are checked equal (`rtol=1e-4`)."
    )
    table = harness.markdown_table(headers, rows)
    return harness.Section("patched", header, table, targets)
