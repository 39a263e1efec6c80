"""Train an `eqx.Module` with optax: an optimiser state, a learning-rate schedule and
donated buffers, with a `filter_jit` training step.

Two ways to write the step: the optimiser passed in as an argument (an
`optax.GradientTransformation` is a tuple of functions: static leaves, keyed by
identity), or closed over. Either way the step is traced once: the schedule reads
the step count from the optimiser state, which is an array, so the learning rate
changes every step without a retrace. `donate="all"` lets XLA update the model and
the optimiser state in place.

Then the per-step cost of the same step under `jax.jit` (on the model's arrays,
split from the rest by hand with `eqx.partition` and `eqx.combine`),
`equinox.filter_jit` and `filterjit.filter_jit`, measured in this run.

    python examples/train_optax.py [--rounds 5]
"""

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

import filterjit
from filterjit import filter_jit


STEPS = 600
BATCH_SIZE = 64
schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0, peak_value=1e-2, warmup_steps=50, decay_steps=STEPS
)
optim = optax.adamw(learning_rate=schedule, weight_decay=1e-4)


def make_model() -> eqx.nn.MLP:
    return eqx.nn.MLP(2, 1, width_size=32, depth=2, key=jax.random.key(0))


def make_batches(count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """NumPy minibatches of y = sin(2 x0) cos(x1), x uniform in [-2, 2]^2. Donated
    buffers are consumed, so each step gets its own."""
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(count):
        x = rng.uniform(-2.0, 2.0, (BATCH_SIZE, 2)).astype(np.float32)
        batches.append((x, np.sin(2 * x[:, :1]) * np.cos(x[:, 1:])))
    return batches


def loss_fn(model: eqx.nn.MLP, x: ArrayLike, y: ArrayLike) -> jax.Array:
    return jnp.mean((jax.vmap(model)(jnp.asarray(x)) - y) ** 2)


def train_step(
    model: eqx.nn.MLP,
    opt_state: optax.OptState,
    optim: optax.GradientTransformation,
    x: ArrayLike,
    y: ArrayLike,
) -> tuple[eqx.nn.MLP, optax.OptState, jax.Array]:
    params = eqx.filter(model, eqx.is_inexact_array)
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    updates, opt_state = optim.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, loss


def closed_over(
    model: eqx.nn.MLP, opt_state: optax.OptState, x: ArrayLike, y: ArrayLike
) -> tuple[eqx.nn.MLP, optax.OptState, jax.Array]:
    return train_step(model, opt_state, optim, x, y)


# The optimiser passed in: its functions are static leaves of the call.
step_passed = filter_jit(train_step, donate="all")
# The optimiser closed over, as most training scripts write it.
step_closed = filter_jit(closed_over, donate="all")


def init(model: eqx.nn.MLP) -> optax.OptState:
    return optim.init(eqx.filter(model, eqx.is_inexact_array))


def train() -> None:
    model_a, model_b = make_model(), make_model()  # donated: one copy each
    state_a, state_b = init(model_a), init(model_b)
    print("step  learning rate    loss")
    for i, (x, y) in enumerate(make_batches(STEPS + 1)):
        model_a, state_a, loss = step_passed(model_a, state_a, optim, x, y)
        model_b, state_b, _ = step_closed(model_b, state_b, x, y)
        if i % 100 == 0:
            learning_rate = float(jnp.asarray(schedule(i)))
            print(f"{i:4}  {learning_rate:13.5f}  {float(loss):6.4f}")
    print("traces of the step, optimiser passed in:", filterjit.num_traces(step_passed))
    print(
        "traces of the step, optimiser closed over:", filterjit.num_traces(step_closed)
    )
    pairs = zip(jax.tree.leaves(model_a), jax.tree.leaves(model_b))
    difference = max(
        float(jnp.max(jnp.abs(a - b))) for a, b in pairs if eqx.is_array(a)
    )
    print(f"the two trained models differ by {difference:.1e}")


# ---------------------------------------------------------------- cost per step


def jax_jit_step() -> Callable[..., Any]:
    """The same step under `jax.jit`, which traces every argument: the model's
    arrays go in and out, and the rest of it is closed over."""
    params, static = eqx.partition(make_model(), eqx.is_array)

    def step(params: Any, opt_state: optax.OptState, x: ArrayLike, y: ArrayLike):
        model, opt_state, loss = train_step(
            eqx.combine(params, static), opt_state, optim, x, y
        )
        return eqx.filter(model, eqx.is_array), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def per_step_cost(rounds: int) -> None:
    """Each contender trains its own model for `rounds` rounds of 200 steps, in
    turn; the median round gives its cost per step, including the time to finish
    the last step."""
    batches = make_batches(200)
    contenders: dict[str, tuple[Callable[..., Any], Any]] = {
        # name: (step(model, opt_state, x, y), the model it trains)
        "jax.jit, hand-partitioned": (
            jax_jit_step(),
            eqx.filter(make_model(), eqx.is_array),
        ),
        "equinox.filter_jit": (
            eqx.filter_jit(closed_over, donate="all"),
            make_model(),
        ),
        "filterjit, optimiser in": (
            lambda model, opt_state, x, y: step_passed(model, opt_state, optim, x, y),
            make_model(),
        ),
        "filterjit, closed over": (step_closed, make_model()),
    }
    states = {name: (model, init(model)) for name, (_, model) in contenders.items()}

    def run(name: str) -> float:
        step = contenders[name][0]
        model, opt_state = states[name]
        start = time.perf_counter()
        for x, y in batches:
            model, opt_state, _ = step(model, opt_state, x, y)
        jax.block_until_ready((model, opt_state))
        elapsed = time.perf_counter() - start
        states[name] = (model, opt_state)
        return elapsed / len(batches)

    names = list(contenders)
    for name in names:
        run(name)  # compiles, and warms up
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        gc.collect()
        # Each round in another order, so that going first costs each alike.
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            samples[name].append(run(name))
    medians = {name: statistics.median(times) for name, times in samples.items()}
    reference = medians["jax.jit, hand-partitioned"]
    print(f"\nCost per step, {len(batches)} steps, median of {rounds} rounds:")
    for name, seconds in medians.items():
        ratio = seconds / reference
        print(f"   {name:27} {seconds * 1e6:7.1f} µs  {ratio:5.2f}x jax.jit")


def main() -> None:
    parser = argparse.ArgumentParser(description="Train an eqx.Module with optax.")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds")
    rounds = parser.parse_args().rounds
    train()
    per_step_cost(rounds)


if __name__ == "__main__":
    main()
