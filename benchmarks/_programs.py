"""Real programs at the top level: a training step that returns its model and
optimiser state, a function with a static leaf in its output, a library that
wraps a function anew on every call, a call that leaves a default out, and calls
given a settings object and a large table as static arguments."""

import dataclasses
from collections.abc import Callable
from typing import Any

import _harness as harness
import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import filterjit


# filterjit ÷ the program's jax.jit baseline (`BASELINES`), per program.
LIMITS = {
    "training step": 1.0,
    "static output": 1.25,
    "fresh wrapper": 1.0,
    "default left out": 1.25,
    "static settings": 2.0,
    "static table": 5.0,
}
# filterjit.jit ÷ the jax.jit baseline, where it has a target: a `jit(f)(x)` made
# anew at every call is jax.jit's own making and call.
JIT_LIMITS = {"fresh wrapper": 1.1}
# filterjit leaving the default out ÷ filterjit passing it.
DEFAULT_LIMIT = 1.05

# What the jax.jit column times, per program: each row's ratios are to it.
BASELINES = {
    "training step": "model arrays partitioned by hand",
    "static output": "`x -> x + 1`",
    "fresh wrapper": "`jax.jit(scale, static_argnums=1)` anew",
    "default left out": "`jax.jit(scale_by, static_argnames='n')`",
    "static settings": "`jax.jit(apply, static_argnums=1)`",
    "static table": "`jax.jit(apply, static_argnums=1)`",
}

# Informational, not a column: jax.jit of the static-output program itself,
# which returns the 3 as an array.
JAX_WHOLE = "jax.jit of `x -> (x + 1, 3)`"
# Informational, not a column: filterjit passing the default it leaves out.
PASSED = "filterjit `scale_by(x, 20)`"


Calls = dict[str, Callable[[], Any]]


def _training_step() -> Calls:
    """`eqx.nn.MLP` and `optax.adam`: `(model, opt_state, x, y) -> (model,
    opt_state, loss)`. jax.jit is given the model's arrays, partitioned by hand,
    and combines them with its static part inside; the optimiser is closed over."""
    model = eqx.nn.MLP(16, 16, 64, 2, key=jax.random.key(0))
    optimiser = optax.adam(1e-3)
    opt_state = optimiser.init(eqx.filter(model, eqx.is_array))
    x = jnp.ones((32, 16))
    y = jnp.zeros((32, 16))

    def step(model: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        def loss_fn(model: Any) -> jax.Array:
            return jnp.mean((jax.vmap(model)(x) - y) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optimiser.update(
            grads, opt_state, eqx.filter(model, eqx.is_array)
        )
        return eqx.apply_updates(model, updates), opt_state, loss

    params, static = eqx.partition(model, eqx.is_array)

    def partitioned_step(params: Any, opt_state: Any, x: Any, y: Any) -> Any:
        model, opt_state, loss = step(eqx.combine(params, static), opt_state, x, y)
        return eqx.filter(model, eqx.is_array), opt_state, loss

    jax_step = jax.jit(partitioned_step)
    jit_step = filterjit.jit(partitioned_step)
    eqx_step = eqx.filter_jit(step)
    filterjit_step = filterjit.filter_jit(step)
    return {
        harness.JAX: lambda: jax_step(params, opt_state, x, y),
        harness.EQX: lambda: eqx_step(model, opt_state, x, y),
        harness.FILTERJIT: lambda: filterjit_step(model, opt_state, x, y),
        harness.FILTERJIT_JIT: lambda: jit_step(params, opt_state, x, y),
    }


def _static_output() -> Calls:
    """`x -> (x + 1, 3)`, the 3 returned as it is. The baseline is jax.jit of
    `x -> x + 1`: the same work without the static output, which is what the
    static output costs filterjit and eqx.filter_jit. jax.jit of the program itself
    (which returns the 3 as an array) is timed too, for reference."""

    def with_static(x: jax.Array) -> tuple[jax.Array, int]:
        return x + 1, 3

    jax_fun = jax.jit(lambda x: x + 1)
    jax_whole = jax.jit(with_static)
    eqx_fun = eqx.filter_jit(with_static)
    filterjit_fun = filterjit.filter_jit(with_static)
    # jax.jit's signature, so jax.jit's outputs: the program without the 3.
    jit_fun = filterjit.jit(lambda x: x + 1)
    x = jnp.ones(4)
    return {
        harness.JAX: lambda: jax_fun(x),
        JAX_WHOLE: lambda: jax_whole(x),
        harness.EQX: lambda: eqx_fun(x),
        harness.FILTERJIT: lambda: filterjit_fun(x),
        harness.FILTERJIT_JIT: lambda: jit_fun(x),
    }


def scale(x: jax.Array, n: int) -> jax.Array:
    return x * n


def _fresh_wrapper() -> Calls:
    """A library that wraps a function anew on each call: `jit(scale)(x, 20)`."""
    x = jnp.ones(4)
    return {
        harness.JAX: lambda: jax.jit(scale, static_argnums=1)(x, 20),
        harness.EQX: lambda: eqx.filter_jit(scale)(x, 20),
        harness.FILTERJIT: lambda: filterjit.filter_jit(scale)(x, 20),
        harness.FILTERJIT_JIT: lambda: filterjit.jit(scale, static_argnums=1)(x, 20),
    }


def scale_by(x: jax.Array, n: int = 20) -> jax.Array:
    return x * n


def _default_left_out() -> Calls:
    """`scale_by(x)`, `n` left to its default of 20 (static); filterjit passing
    it, `scale_by(x, 20)`, is timed too: the two should cost the same."""
    x = jnp.ones(4)
    jax_fun = jax.jit(scale_by, static_argnames="n")
    eqx_fun = eqx.filter_jit(scale_by)
    filterjit_fun = filterjit.filter_jit(scale_by)
    jit_fun = filterjit.jit(scale_by, static_argnames="n")
    return {
        harness.JAX: lambda: jax_fun(x),
        harness.EQX: lambda: eqx_fun(x),
        harness.FILTERJIT: lambda: filterjit_fun(x),
        PASSED: lambda: filterjit_fun(x, 20),
        harness.FILTERJIT_JIT: lambda: jit_fun(x),
    }


@dataclasses.dataclass(frozen=True)
class Settings:
    """A user's settings: static, compared by value (a frozen dataclass)."""

    scale: float
    activation: str


@dataclasses.dataclass(frozen=True)
class Table:
    """A large static table: 10,000 floats."""

    values: tuple[float, ...]


def apply(x: jax.Array, settings: Any) -> jax.Array:
    return x + 1


def _static_value(value: Any) -> Callable[[], Calls]:
    """`apply(x, value)`, `value` static (a frozen dataclass, keyed by value)."""

    def make() -> Calls:
        x = jnp.ones(4)
        jax_fun = jax.jit(apply, static_argnums=1)
        eqx_fun = eqx.filter_jit(apply)
        filterjit_fun = filterjit.filter_jit(apply)
        jit_fun = filterjit.jit(apply, static_argnums=1)
        return {
            harness.JAX: lambda: jax_fun(x, value),
            harness.EQX: lambda: eqx_fun(x, value),
            harness.FILTERJIT: lambda: filterjit_fun(x, value),
            harness.FILTERJIT_JIT: lambda: jit_fun(x, value),
        }

    return make


PROGRAMS: dict[str, Callable[[], Calls]] = {
    "training step": _training_step,
    "static output": _static_output,
    "fresh wrapper": _fresh_wrapper,
    "default left out": _default_left_out,
    "static settings": _static_value(Settings(0.5, "relu")),
    "static table": _static_value(Table(tuple(float(i) for i in range(10_000)))),
}


def run(settings: harness.Settings) -> harness.Section:
    rounds = settings.pick(full=31, quick=3)
    calls = settings.pick(full=200, quick=4)
    names = [harness.JAX, harness.EQX, harness.FILTERJIT, harness.FILTERJIT_JIT]
    headers = harness.program_headers(names, settings.targets)
    rows = []
    targets = []
    notes = []
    ratios = []
    for program, make in PROGRAMS.items():
        us = harness.microseconds(make(), rounds, calls)
        row = [
            program,
            BASELINES[program],
            *(harness.fmt_number(us[name]) for name in names),
        ]
        row += [harness.fmt_ratio(us[name], us[harness.JAX]) for name in names[1:]]
        ratios.append(
            harness.RatioRow(
                program,
                {name: us[name] / us[harness.JAX] for name in names},
                LIMITS[program],
            )
        )
        if settings.targets:
            value = us[harness.FILTERJIT] / us[harness.JAX]
            target = harness.Target("programs", program, value, LIMITS[program], "×")
            targets.append(target)
            row += [target.describe(), target.verdict]
            if program in JIT_LIMITS:
                value = us[harness.FILTERJIT_JIT] / us[harness.JAX]
                name = f"{program} ({harness.FILTERJIT_JIT})"
                limit = JIT_LIMITS[program]
                targets.append(harness.Target("programs", name, value, limit, "×"))
        rows.append(row)
        if JAX_WHOLE in us:
            notes.append(
                f"{JAX_WHOLE} (the 3 comes back as an array): "
                f"{harness.fmt_number(us[JAX_WHOLE])} µs; filterjit ÷ that: "
                f"{harness.fmt_ratio(us[harness.FILTERJIT], us[JAX_WHOLE])}×, "
                "eqx.filter_jit ÷ "
                f"that: {harness.fmt_ratio(us[harness.EQX], us[JAX_WHOLE])}×."
            )
        if PASSED in us:
            left_out = us[harness.FILTERJIT] / us[PASSED]
            notes.append(
                f"{PASSED} (the default passed): {harness.fmt_number(us[PASSED])} µs; "
                f"leaving it out ÷ passing it: {harness.fmt_ratio(left_out, 1.0)}×."
            )
            if settings.targets:
                name = "default left out ÷ passed"
                targets.append(
                    harness.Target("programs", name, left_out, DEFAULT_LIMIT, "×")
                )
    header = (
        "Median µs per top-level call of six real programs, each implementation "
        f"in the same interleaved rounds ({rounds} rounds of {calls} calls); every "
        "ratio is to the row's jax.jit baseline. Training step: an `eqx.nn.MLP` "
        "(16 -> 64 -> 64 -> 16) and `optax.adam` on a batch of 32, returning "
        "`(model, opt_state, loss)`; jax.jit is given the model's arrays "
        "partitioned by hand (`eqx.partition`) and combines them inside. Static "
        "output: `x -> (x + 1, 3)`, the 3 returned as it is; jax.jit is timed on "
        "`x -> x + 1`, the same work without the static output. Fresh wrapper: "
        "`jit(scale)(x, 20)`, the wrapper made anew on every call, as libraries "
        "do; jax.jit with `n` in `static_argnums`. Default left out: "
        "`scale_by(x)`, whose `n=20` is static; jax.jit with `n` in "
        "`static_argnames`. Static settings and static table: `apply(x, value)`, "
        "`value` a frozen dataclass of a float and a string, or of a tuple of "
        "10,000 floats; jax.jit with it in `static_argnums`. filterjit.jit (jax.jit's "
        "signature, jax.jit at the top level) runs what jax.jit runs: the "
        "partitioned step, `x -> x + 1`, `scale` with `static_argnums=1`."
    )
    table = harness.markdown_table(headers, rows, left=2)
    return harness.Section("programs", header, table, targets, notes, ratios)
