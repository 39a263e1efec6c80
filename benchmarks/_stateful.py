"""Stateful programs at the top level: a training step of a model with a
BatchNorm layer, whose state (`eqx.nn.State`) goes in and comes out of every
step, and a call that only passes a State along."""

import warnings
from collections.abc import Callable
from typing import Any

import _harness as harness
import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import filterjit


# filterjit ÷ the program's jax.jit baseline, per program.
LIMITS = {"stateful step": 1.0, "state passed": 1.3}

BASELINES = {
    "stateful step": "model and state arrays partitioned by hand",
    "state passed": "the State's arrays as a tuple",
}

Calls = dict[str, Callable[[], Any]]


class _Model(eqx.Module):
    """Linear -> BatchNorm -> Linear, applied to one example (vmapped over a batch
    whose axis is named "batch")."""

    first: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    last: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.first = eqx.nn.Linear(16, 64, key=k1)
        self.norm = eqx.nn.BatchNorm(64, axis_name="batch", mode="batch")
        self.last = eqx.nn.Linear(64, 16, key=k2)

    def __call__(self, x: jax.Array, state: eqx.nn.State) -> Any:
        x = jax.nn.relu(self.first(x))
        x, state = self.norm(x, state)
        return self.last(x), state


def _made() -> tuple[Any, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BatchNorm's notes on its modes
        return eqx.nn.make_with_state(_Model)(jax.random.key(0))


def _stateful_step() -> Calls:
    """`(model, state, opt_state, x, y) -> (model, state, opt_state, loss)` with
    `optax.adam`. jax.jit is given the same arrays, the model's and the state's
    partitioned by hand, and combines them with their static parts inside."""
    model, state = _made()
    optimiser = optax.adam(1e-3)
    opt_state = optimiser.init(eqx.filter(model, eqx.is_array))
    x = jnp.ones((32, 16))
    y = jnp.zeros((32, 16))

    def step(model: Any, state: Any, opt_state: Any, x: Any, y: Any) -> Any:
        def loss_fn(model: Any, state: Any) -> Any:
            batched = jax.vmap(
                model, in_axes=(0, None), out_axes=(0, None), axis_name="batch"
            )
            out, state = batched(x, state)
            return jnp.mean((out - y) ** 2), state

        (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
            model, state
        )
        updates, opt_state = optimiser.update(
            grads, opt_state, eqx.filter(model, eqx.is_array)
        )
        return eqx.apply_updates(model, updates), state, opt_state, loss

    params, static = eqx.partition(model, eqx.is_array)
    state_leaves, state_def = jax.tree_util.tree_flatten(state)

    def partitioned_step(
        params: Any, leaves: Any, opt_state: Any, x: Any, y: Any
    ) -> Any:
        state = jax.tree_util.tree_unflatten(state_def, leaves)
        out = step(eqx.combine(params, static), state, opt_state, x, y)
        model, state, opt_state, loss = out
        return (
            eqx.filter(model, eqx.is_array),
            state_def.flatten_up_to(state),
            opt_state,
            loss,
        )

    jax_step = jax.jit(partitioned_step)
    eqx_step = eqx.filter_jit(step)
    filterjit_step = filterjit.filter_jit(step)
    return {
        harness.JAX: lambda: jax_step(params, state_leaves, opt_state, x, y),
        harness.EQX: lambda: eqx_step(model, state, opt_state, x, y),
        harness.FILTERJIT: lambda: filterjit_step(model, state, opt_state, x, y),
    }


def _state_passed() -> Calls:
    """`(x, state) -> (x + 1, state)`: the State passed along unchanged. jax.jit
    is given the State's arrays as a tuple and returns them."""
    _, state = _made()
    leaves = tuple(jax.tree_util.tree_leaves(state))
    x = jnp.ones(4)

    def passed(x: jax.Array, state: Any) -> Any:
        return x + 1, state

    jax_fun = jax.jit(passed)
    eqx_fun = eqx.filter_jit(passed)
    filterjit_fun = filterjit.filter_jit(passed)
    return {
        harness.JAX: lambda: jax_fun(x, leaves),
        harness.EQX: lambda: eqx_fun(x, state),
        harness.FILTERJIT: lambda: filterjit_fun(x, state),
    }


PROGRAMS: dict[str, Callable[[], Calls]] = {
    "stateful step": _stateful_step,
    "state passed": _state_passed,
}


def run(settings: harness.Settings) -> harness.Section:
    rounds = settings.pick(full=31, quick=3)
    calls = settings.pick(full=200, quick=4)
    names = [harness.JAX, harness.EQX, harness.FILTERJIT]
    headers = harness.program_headers(names, settings.targets)
    rows = []
    targets = []
    for program, make in PROGRAMS.items():
        us = harness.microseconds(make(), rounds, calls)
        row = [program, BASELINES[program], *(harness.fmt_number(us[n]) for n in names)]
        row += [harness.fmt_ratio(us[name], us[harness.JAX]) for name in names[1:]]
        if settings.targets:
            value = us[harness.FILTERJIT] / us[harness.JAX]
            target = harness.Target("stateful", program, value, LIMITS[program], "×")
            targets.append(target)
            row += [target.describe(), target.verdict]
        rows.append(row)
    header = (
        "Median µs per top-level call of two programs whose arguments hold an "
        f"`eqx.nn.State`, each implementation in the same interleaved rounds "
        f"({rounds} rounds of {calls} calls); every ratio is to the row's jax.jit "
        "baseline. Stateful step: Linear -> BatchNorm -> Linear (16 -> 64 -> 16, "
        "`eqx.nn.make_with_state`, vmapped with `axis_name='batch'`) and "
        "`optax.adam` on a batch of 32, returning `(model, state, opt_state, "
        "loss)`; jax.jit is given the model's and the state's arrays partitioned "
        "by hand and combines them inside. State passed: `(x, state) -> (x + 1, "
        "state)`; jax.jit is given the State's arrays as a tuple."
    )
    table = harness.markdown_table(headers, rows, left=2)
    return harness.Section("stateful", header, table, targets)
