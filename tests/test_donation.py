"""Donation at the top level; ignored when nested."""

import dataclasses
import functools as ft
import gc
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import pytest
from differential import assert_tree_allclose

from filterjit import filter_jit


def _step(state, batch):
    return {"w": state["w"] + batch.sum()}, batch * 2


@pytest.mark.parametrize(
    "donate, state_deleted, batch_deleted",
    [
        ("none", False, False),
        ("all", True, True),
        ("warn", True, True),
        ("all-except-first", False, True),
        ("warn-except-first", False, True),
        (("state",), True, False),
        (("batch",), False, True),
    ],
)
def test_donation_at_the_top_level(donate, state_deleted, batch_deleted):
    f = filter_jit(_step, donate=donate)
    state = {"w": jnp.ones(4)}
    batch = jnp.arange(4.0)
    new_state, out = f(state, batch)
    assert state["w"].is_deleted() == state_deleted
    assert batch.is_deleted() == batch_deleted
    assert new_state["w"].tolist() == [7.0] * 4
    assert out.tolist() == [0.0, 2.0, 4.0, 6.0]


def test_donation_is_ignored_when_nested_and_under_eager_transforms():
    f = filter_jit(lambda x: x * 2, donate="all")
    x = jnp.arange(3.0)
    assert jax.jit(lambda x: f(x) + 1)(x).tolist() == [1.0, 3.0, 5.0]
    assert jax.grad(lambda x: f(x).sum())(x).tolist() == [2.0] * 3
    assert not x.is_deleted()
    f(x)
    assert x.is_deleted()


def test_donating_wrapper_does_not_keep_the_function_alive():
    def make():
        offset = jnp.ones(3)
        return lambda state: state + offset

    fun = make()
    ref = weakref.ref(fun)
    wrapped = filter_jit(fun, donate="all")
    wrapped(jnp.zeros(3))
    del fun, wrapped
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("donate", ["all", "all-except-first", "warn"])
def test_repeated_calls_donate_and_warn_as_the_first(donate):
    # A training loop: every call donates, and only the "warn" options warn about
    # a donated buffer that the output cannot reuse (here `batch`, of which
    # nothing is returned); JAX says so when it compiles, as with jax.jit.
    f = filter_jit(lambda state, batch: {"w": state["w"] + batch.sum()}, donate=donate)
    state = {"w": jnp.ones(4)}
    for step in range(3):
        batch = jnp.arange(4.0)
        old = state["w"]
        if donate == "warn" and step == 0:
            with pytest.warns(
                UserWarning, match="Some donated buffers were not usable"
            ):
                state = f(state, batch)
        else:
            state = f(state, batch)
        assert old.is_deleted() == (donate != "all-except-first")
        assert state["w"].tolist() == [1.0 + 6.0 * (step + 1)] * 4


def _scale(w, x):
    return w * x


@pytest.mark.parametrize("donate", ["all", "all-except-first", "warn"])
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_what_a_partial_binds_is_never_donated(donate):
    w = jnp.ones(3)
    f = filter_jit(ft.partial(_scale, w), donate=donate)
    x = jnp.arange(3.0)
    assert f(x).tolist() == [0.0, 1.0, 2.0]
    assert not w.is_deleted()
    # The same with jax.jit, whose partial's `w` is a constant.
    assert f(jnp.arange(3.0)).tolist() == [0.0, 1.0, 2.0]
    assert x.is_deleted() == (donate != "all-except-first")


@jtu.register_dataclass
@dataclasses.dataclass
class _Layer:
    w: jax.Array

    def step(self, x):
        return self.w + x, x * 2


@pytest.mark.parametrize(
    "donate, self_deleted, x_deleted",
    [
        ("none", False, False),
        ("all", True, True),
        ("all-except-first", False, True),  # `self` is the first argument
        (("self",), True, False),
        (("x",), False, True),
    ],
)
def test_a_bound_methods_receiver_is_its_first_argument(
    donate, self_deleted, x_deleted
):
    layer = _Layer(jnp.ones(3))
    x = jnp.arange(3.0)
    out = filter_jit(layer.step, donate=donate)(x)
    assert [o.tolist() for o in out] == [[1.0, 2.0, 3.0], [0.0, 2.0, 4.0]]
    assert layer.w.is_deleted() == self_deleted
    assert x.is_deleted() == x_deleted


@pytest.mark.parametrize("donate", ["all", "all-except-first"])
def test_a_method_decorated_in_its_class_donates_self_as_its_first_argument(
    donate,
):
    @jtu.register_dataclass
    @dataclasses.dataclass
    class Layer:
        w: jax.Array

        @ft.partial(filter_jit, donate=donate)
        def step(self, x):
            return self.w + x, x * 2

    layer = Layer(jnp.ones(3))
    x = jnp.arange(3.0)
    layer.step(x)
    assert layer.w.is_deleted() == (donate == "all")
    assert x.is_deleted()


def _with_keywords(x, **kw):
    return x + kw["state"], kw["state"] * 2


def test_keywords_collected_by_kwargs_are_donated_by_their_names():
    state, x = jnp.ones(3), jnp.arange(3.0)
    filter_jit(_with_keywords, donate=("state",))(x, state=state)
    assert state.is_deleted() and not x.is_deleted()
    # As jax.jit's donate_argnames.
    state, x = jnp.ones(3), jnp.arange(3.0)
    jax.jit(_with_keywords, donate_argnames=("state",))(x, state=state)
    assert state.is_deleted() and not x.is_deleted()


def test_naming_the_kwargs_parameter_or_an_unknown_one_is_a_clear_error():
    with pytest.raises(ValueError, match=r"`\*\*kw` parameter.*donate=\('state',\)"):
        filter_jit(_with_keywords, donate=("kw",))
    with pytest.raises(ValueError, match=r"'y', which is not a parameter of '_scale'"):
        filter_jit(_scale, donate=("y",))
    with pytest.raises(ValueError, match=r"not a parameter name"):
        filter_jit(_scale, donate=(0,))  # pyright: ignore[reportCallIssue, reportArgumentType]
    # What a partial binds positionally is no parameter of it any more.
    with pytest.raises(ValueError, match=r"'w', which is not a parameter"):
        filter_jit(ft.partial(_scale, jnp.ones(3)), donate=("w",))


_DEFAULT = jnp.ones(3)


def _with_default(x, y=_DEFAULT):
    return x + y, y * 2


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_a_default_is_not_donated_but_the_same_parameter_passed_is():
    f = filter_jit(_with_default, donate="all")
    for _ in range(2):
        assert f(jnp.arange(3.0))[0].tolist() == [1.0, 2.0, 3.0]
    assert not _DEFAULT.is_deleted()
    y = jnp.ones(3)
    f(jnp.arange(3.0), y)
    assert y.is_deleted()
    y = jnp.ones(3)
    f(jnp.arange(3.0), y=y)
    assert y.is_deleted()
    assert not _DEFAULT.is_deleted()


class _Model(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return self.w + x, x * 2


@pytest.mark.parametrize("method", [False, True], ids=["module", "module.__call__"])
@pytest.mark.parametrize(
    "donate, self_deleted, x_deleted",
    [("all", True, True), ("all-except-first", False, True), (("self",), True, False)],
)
def test_a_callable_module_is_the_receiver_of_its_call(
    method, donate, self_deleted, x_deleted
):
    model, x = _Model(jnp.ones(3)), jnp.arange(3.0)
    filter_jit(model.__call__ if method else model, donate=donate)(x)
    assert model.w.is_deleted() == self_deleted
    assert x.is_deleted() == x_deleted


class _Scaler(eqx.Module):
    factor: float = eqx.field(static=True)

    def __call__(self, x, y):
        return x * self.factor, y + 1


@pytest.mark.parametrize("method", [False, True], ids=["module", "module.__call__"])
def test_a_callable_module_without_arrays_is_still_its_calls_first_argument(method):
    # "first" is `self` whatever it holds, so that every instance of a class reads
    # its call alike: the call's own arguments are all donated.
    scaler, x, y = _Scaler(2.0), jnp.arange(3.0), jnp.ones(3)
    filter_jit(scaler.__call__ if method else scaler, donate="all-except-first")(x, y)
    assert x.is_deleted() and y.is_deleted()


def test_with_donation_a_scalar_default_given_or_not_is_one_key():
    traces = []

    def f(x, n=3):
        traces.append(n)
        return x * n

    g = filter_jit(f, donate="all")
    g(jnp.ones(3))
    g(jnp.ones(3), n=3)
    g(jnp.ones(3), 3)
    assert traces == [3]


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_a_compiled_call_never_donates_a_default():
    # Core v6, finding 7: lowered with `w` passed, the compiled call left `w` to its
    # default array, and donated (deleted) it; jax.jit's compiled object refuses.
    w0 = jnp.ones(3)

    def f(x, w=w0):
        return x + w

    g = filter_jit(f, donate="all")
    compiled = g.lower(jnp.ones(3), jnp.ones(3)).compile()
    with pytest.raises(TypeError, match="defaults \\(w"):
        compiled(jnp.ones(3))
    assert not w0.is_deleted()
    assert_tree_allclose(g(jnp.ones(3)), jnp.full(3, 2.0))
    assert_tree_allclose(compiled(jnp.ones(3), jnp.ones(3)), jnp.full(3, 2.0))
