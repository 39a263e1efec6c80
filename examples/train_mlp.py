"""Train an `eqx.nn.MLP` on synthetic data with a `filter_jit` training step.

The step takes the model, a minibatch of NumPy arrays and a Python float learning
rate. The model's arrays and the minibatch are traced; its activation functions and
the learning rate are static. Every minibatch has the same shape and dtype, so the
step is traced and compiled once.

    python examples/train_mlp.py
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

import filterjit
from filterjit import filter_jit


def make_data(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    """y = sin(2 x0) cos(x1) + noise, for x uniform in [-2, 2]^2."""
    x = rng.uniform(-2.0, 2.0, (size, 2)).astype(np.float32)
    y = np.sin(2 * x[:, :1]) * np.cos(x[:, 1:])
    y += 0.05 * rng.standard_normal(y.shape).astype(np.float32)
    return x, y


def loss_fn(model: eqx.nn.MLP, x: ArrayLike, y: ArrayLike) -> jax.Array:
    return jnp.mean((jax.vmap(model)(jnp.asarray(x)) - y) ** 2)


@filter_jit
def step(
    model: eqx.nn.MLP, x: ArrayLike, y: ArrayLike, learning_rate: float
) -> tuple[eqx.nn.MLP, jax.Array]:
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    updates = jax.tree.map(lambda g: -learning_rate * g, grads)
    return eqx.apply_updates(model, updates), loss


@filter_jit
def evaluate(model: eqx.nn.MLP, x: ArrayLike, y: ArrayLike) -> jax.Array:
    return loss_fn(model, x, y)


def main() -> None:
    rng = np.random.default_rng(0)
    x_train, y_train = make_data(rng, 4096)
    x_test, y_test = make_data(rng, 1024)
    model = eqx.nn.MLP(2, 1, width_size=64, depth=2, key=jax.random.key(0))

    batch_size = 128
    print("step  train loss  test loss")
    for i in range(2001):
        index = rng.integers(0, len(x_train), batch_size)
        model, loss = step(model, x_train[index], y_train[index], 0.05)
        if i % 250 == 0:
            test_loss = evaluate(model, x_test, y_test)
            print(f"{i:4}  {float(loss):10.4f}  {float(test_loss):9.4f}")
    print(f"traces of step: {filterjit.num_traces(step)}")
    print(f"traces of evaluate: {filterjit.num_traces(evaluate)}")


if __name__ == "__main__":
    main()
