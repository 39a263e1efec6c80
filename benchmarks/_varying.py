"""Top-level calls whose static inputs vary from call to call.

Each row is a call pattern of real code in which what a jit keys on changes
between calls: a static argument that alternates between two types or two values,
an optional argument given or left `None`, a Module, wrapper or `PartitionSpec`
made anew at every step, and a large static tuple, passed or held in a Module's
static field. Every implementation computes the same thing; jax.jit (and nnx.jit,
where the row is a plain function) is the closest jax.jit program: the static
value in `static_argnums`, and a wrapper made once where filterjit and Equinox
make one anew.
"""

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import _harness as harness
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import filterjit


LIMIT = 1.3  # filterjit ÷ jax.jit, every row
EQX_LIMIT = 1.0  # filterjit ÷ eqx.filter_jit, every row: never slower than Equinox
WIDTH = 16
TUPLE_LENGTH = 10_000


@dataclasses.dataclass(frozen=True)
class Row:
    """One call pattern: `arguments(n)` makes the arguments of `n` consecutive
    calls (untimed, so that making a Module or a spec anew costs no
    implementation anything), and `impls` maps each implementation's name to the
    function that makes one call from one of them."""

    label: str
    text: str
    arguments: Callable[[int], Sequence[Any]]
    impls: dict[str, Callable[[Any], Any]]


def _alternate(*values: Any) -> Callable[[int], list[Any]]:
    return lambda n: list(itertools.islice(itertools.cycle(values), n))


def _scale(x: jax.Array, k: Any) -> jax.Array:
    return x * k + 1


def _masked(x: jax.Array, mask: jax.Array | None) -> jax.Array:
    y = jnp.tanh(x)
    return y if mask is None else jnp.where(mask, y, 0.0)


def _train_or_eval(x: jax.Array, training: bool) -> jax.Array:
    return jnp.tanh(x) * 0.9 if training else jnp.tanh(x)


def _tuple_sum(x: jax.Array, table: tuple[float, ...]) -> jax.Array:
    return x + table[0] + table[-1]


def _plain(
    fun: Callable[..., jax.Array], static: bool = True
) -> dict[str, Callable[..., Any]]:
    """The four jits of `fun(x, value)`: jax.jit and nnx.jit with `value` static
    (or a pytree argument, with `static=False`), Equinox and filterjit with
    `value` as it comes."""
    static_argnums = (1,) if static else ()
    impls: dict[str, Callable[..., Any]] = {
        harness.JAX: jax.jit(fun, static_argnums=static_argnums),
        harness.EQX: eqx.filter_jit(fun),
    }
    nnx = harness.optional_nnx()
    if nnx is not None:
        impls[harness.NNX] = nnx.jit(fun, static_argnums=static_argnums)
    impls[harness.FILTERJIT] = filterjit.filter_jit(fun)
    return impls


class _Layer(eqx.Module):
    """A layer with a static field left at its default, `None`."""

    weight: jax.Array
    bias: jax.Array
    activation: Callable[[jax.Array], jax.Array] | None = eqx.field(
        static=True, default=None
    )

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x * self.weight + self.bias
        return y if self.activation is None else self.activation(y)


def _apply_layer(layer: _Layer, x: jax.Array) -> jax.Array:
    return layer(x)


def _fresh_layers(layer: _Layer) -> Callable[[int], list[_Layer]]:
    """Each call's layer made from the last with `eqx.tree_at`, as a training
    step makes it."""

    def arguments(n: int) -> list[_Layer]:
        layers = []
        current = layer
        for _ in range(n):
            current = eqx.tree_at(lambda m: m.bias, current, current.bias + 1e-3)
            layers.append(current)
        return layers

    return arguments


def _eqx_anew(layer: _Layer, x: jax.Array) -> jax.Array:
    return eqx.filter_jit(layer)(x)


def _filterjit_anew(layer: _Layer, x: jax.Array) -> jax.Array:
    return filterjit.filter_jit(layer)(x)


def _layer_row(x: jax.Array) -> Row:
    layer = _Layer(jnp.ones((WIDTH,), jnp.float32), jnp.zeros((WIDTH,), jnp.float32))
    on_module = jax.jit(_apply_layer)
    return Row(
        "(c) model wrapped anew",
        "`filter_jit(model)(x)` each step, the Module (a static field left at "
        "`None`) made anew by `eqx.tree_at`; jax.jit: one `jax.jit(lambda m, x: "
        "m(x))` given each new Module",
        _fresh_layers(layer),
        {
            harness.JAX: lambda m: on_module(m, x),
            harness.EQX: lambda m: _eqx_anew(m, x),
            harness.FILTERJIT: lambda m: _filterjit_anew(m, x),
        },
    )


def _spec_row(x: jax.Array) -> Row:
    mesh = jax.make_mesh((1,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))

    def constrain(x: jax.Array, spec: jax.sharding.PartitionSpec) -> jax.Array:
        sharding = jax.sharding.NamedSharding(mesh, spec)
        return jax.lax.with_sharding_constraint(jnp.tanh(x), sharding)

    impls = _plain(constrain)
    return Row(
        "(d) PartitionSpec made anew",
        "`f(x, PartitionSpec('batch'))`, the spec made anew for every call, static",
        lambda n: [jax.sharding.PartitionSpec("batch") for _ in range(n)],
        {name: lambda spec, fun=fun: fun(x, spec) for name, fun in impls.items()},
    )


class _Net(eqx.Module):
    weight: jax.Array
    dropout: eqx.nn.Dropout

    def __call__(self, x: jax.Array, key: jax.Array) -> jax.Array:
        return self.dropout(jnp.tanh(x * self.weight), key=key)


def _apply_net(net: _Net, x: jax.Array, key: jax.Array) -> jax.Array:
    return net(x, key)


def _net_flat(
    weight: jax.Array, x: jax.Array, key: jax.Array, inference: bool
) -> jax.Array:
    """`_Net`'s work with its weight passed flat and `inference` static."""
    return eqx.nn.Dropout(0.1, inference=inference)(jnp.tanh(x * weight), key=key)


def _inference_row(x: jax.Array) -> Row:
    net = _Net(jnp.ones((WIDTH,), jnp.float32), eqx.nn.Dropout(0.1))
    train, evaluate = net, eqx.nn.inference_mode(net)
    key = jax.random.key(0)
    flat = jax.jit(_net_flat, static_argnums=3)
    eqx_apply = eqx.filter_jit(_apply_net)
    filterjit_apply = filterjit.filter_jit(_apply_net)
    return Row(
        "(e2) inference_mode alternating",
        "`apply(net, x, key)`, `net` and `eqx.nn.inference_mode(net)` in turn (a "
        "Dropout's `inference` flag); jax.jit: the weight flat, `inference` static",
        _alternate(train, evaluate),
        {
            harness.JAX: lambda m: flat(m.weight, x, key, m.dropout.inference),
            harness.EQX: lambda m: eqx_apply(m, x, key),
            harness.FILTERJIT: lambda m: filterjit_apply(m, x, key),
        },
    )


def _vmapped(x: jax.Array) -> jax.Array:
    # No docstring: its `__doc__` is None, as most functions' are.
    return jnp.tanh(x) * 2


def _jit_anew(
    jit: Callable[..., Any], fun: Callable[..., jax.Array], xs: jax.Array
) -> jax.Array:
    return jit(fun)(xs)


def _vmap_row(xs: jax.Array) -> Row:
    once = jax.jit(jax.vmap(_vmapped))
    return Row(
        "(f) filter_jit(filter_vmap(f)) anew",
        "`filter_jit(vmapped)(xs)`, `vmapped = eqx.filter_vmap(f)` made anew for "
        "every call, `f` without a docstring; jax.jit: `jax.jit(jax.vmap(f))` made "
        "once",
        lambda n: [eqx.filter_vmap(_vmapped) for _ in range(n)],
        {
            harness.JAX: lambda _: once(xs),
            harness.EQX: lambda vmapped: _jit_anew(eqx.filter_jit, vmapped, xs),
            harness.FILTERJIT: lambda vmapped: _jit_anew(
                filterjit.filter_jit, vmapped, xs
            ),
        },
    )


class _Table(eqx.Module):
    table: tuple[float, ...] = eqx.field(static=True)


def _table_field_sum(x: jax.Array, holder: _Table) -> jax.Array:
    return _tuple_sum(x, holder.table)


def _table_field_row(x: jax.Array, table: tuple[float, ...]) -> Row:
    holder = _Table(table)
    on_module = jax.jit(_table_field_sum)
    eqx_sum = eqx.filter_jit(_table_field_sum)
    filterjit_sum = filterjit.filter_jit(_table_field_sum)
    return Row(
        "(g2) 10,000-float static field",
        f"`f(x, holder)`, `holder` a Module whose static field is one tuple of "
        f"{TUPLE_LENGTH:,} floats; jax.jit given the Module",
        lambda n: [holder] * n,
        {
            harness.JAX: lambda h: on_module(x, h),
            harness.EQX: lambda h: eqx_sum(x, h),
            harness.FILTERJIT: lambda h: filterjit_sum(x, h),
        },
    )


def _rows(x: jax.Array) -> list[Row]:
    mask = x > 0
    table = tuple(float(i) for i in range(TUPLE_LENGTH))

    def over(
        fun: Callable[..., jax.Array], static: bool = True
    ) -> dict[str, Callable[[Any], Any]]:
        impls = _plain(fun, static)
        return {name: lambda v, fun=fun: fun(x, v) for name, fun in impls.items()}

    return [
        Row(
            "(a) static 2 / 2.0",
            "`f(x, 2)` and `f(x, 2.0)` in turn, static",
            _alternate(2, 2.0),
            over(_scale),
        ),
        Row(
            "(b) mask None / array",
            "`f(x, None)` and `f(x, mask)` in turn; jax.jit and nnx.jit take the "
            "mask as a pytree argument (`None` has no leaves)",
            _alternate(None, mask),
            over(_masked, static=False),
        ),
        _layer_row(x),
        _spec_row(x),
        Row(
            "(e1) training True / False",
            "`f(x, training)`, `True` and `False` in turn, static",
            _alternate(True, False),
            over(_train_or_eval),
        ),
        _inference_row(x),
        _vmap_row(jnp.stack([x, x * 2])),
        Row(
            "(g1) 10,000-float static tuple",
            f"`f(x, table)`, `table` one tuple of {TUPLE_LENGTH:,} floats, static",
            lambda n: [table] * n,
            over(_tuple_sum),
        ),
        _table_field_row(x, table),
    ]


def _fresh_batch(
    arguments: Callable[[int], Sequence[Any]], call: Callable[[Any], Any], calls: int
) -> Callable[[], float]:
    """A case for `harness.interleave`: seconds per call of `calls` back-to-back
    calls, each on the next of `arguments(calls + 1)`, made before the clock
    starts. One untimed call first, as `harness.time_batch` makes."""

    def batch() -> float:
        args = arguments(calls + 1)
        harness.block(call(args[0]))
        outputs: list[Any] = [None] * calls
        start = time.perf_counter_ns()
        for i in range(calls):
            outputs[i] = call(args[i + 1])
        stop = time.perf_counter_ns()
        harness.block(outputs)
        return (stop - start) * 1e-9 / calls

    return batch


def _calls_per_batch(
    row: Row, call: Callable[[Any], Any], budget: float, most: int
) -> int:
    """How many calls of `call` fill about `budget` seconds (2 to `most`): a call
    that traces every time takes milliseconds, a cache hit microseconds."""
    args = row.arguments(4)
    start = time.perf_counter()
    harness.block([call(arg) for arg in args])
    each = (time.perf_counter() - start) / len(args)
    return max(2, min(most, int(budget / max(each, 1e-9))))


def run(settings: harness.Settings) -> harness.Section:
    x = jnp.linspace(-1.0, 1.0, WIDTH, dtype=jnp.float32)
    rows = _rows(x)
    rounds = settings.pick(full=21, quick=2)
    budget = 0.005 if not settings.quick else 0.001
    most = settings.pick(full=400, quick=8)
    names = [harness.JAX, harness.EQX, harness.NNX, harness.FILTERJIT]
    headers = ["pattern", *(f"{name} (µs)" for name in names)]
    headers += [f"{name} ÷ jax.jit" for name in names[1:]]
    headers += ["filterjit ÷ eqx"]
    if settings.targets:
        headers += ["target", "result", "eqx target", "result"]
    table = []
    targets = []
    ratios = []
    for row in rows:
        # The same result from every implementation, and each one warm: every
        # value of the pattern seen at least twice.
        expected = [row.impls[harness.JAX](arg) for arg in row.arguments(4)]
        for name, call in row.impls.items():
            got = [call(arg) for arg in row.arguments(4)]
            for want, have in zip(expected, got, strict=True):
                np.testing.assert_allclose(have, want, rtol=1e-6, err_msg=name)
        cases = {
            name: _fresh_batch(
                row.arguments, call, _calls_per_batch(row, call, budget, most)
            )
            for name, call in row.impls.items()
        }
        medians = harness.interleave(cases, rounds)
        us = {name: medians[name] * 1e6 if name in medians else None for name in names}
        line = [row.label, *(harness.fmt_number(us[name]) for name in names)]
        line += [harness.fmt_ratio(us[name], us[harness.JAX]) for name in names[1:]]
        line += [harness.fmt_ratio(us[harness.FILTERJIT], us[harness.EQX])]
        ratios.append(
            harness.RatioRow(
                row.label,
                {name: medians[name] / medians[harness.JAX] for name in medians},
                LIMIT,
            )
        )
        if settings.targets:
            to_jax = harness.Target(
                "varying",
                f"{row.label} ÷ jax.jit",
                medians[harness.FILTERJIT] / medians[harness.JAX],
                LIMIT,
                "×",
            )
            to_eqx = harness.Target(
                "varying",
                f"{row.label} ÷ eqx.filter_jit",
                medians[harness.FILTERJIT] / medians[harness.EQX],
                EQX_LIMIT,
                "×",
            )
            targets += [to_jax, to_eqx]
            line += [to_jax.describe(), to_jax.verdict]
            line += [to_eqx.describe(), to_eqx.verdict]
        table.append(line)
    patterns = "; ".join(f"**{row.label}**: {row.text}" for row in rows)
    header = (
        "Median µs per top-level call where what a jit keys on varies from call to "
        f"call, x a float32[{WIDTH}]. Patterns: {patterns}. nnx.jit is measured "
        "where the row is a plain function. The arguments of each batch are made "
        f"before its clock starts; {rounds} interleaved rounds, each timing a batch "
        "of back-to-back calls of every implementation (as many as fill about "
        f"{budget * 1e3:.0f} ms, from 2 to {most}). Targets: filterjit ≤ "
        f"{LIMIT}× jax.jit and ≤ {EQX_LIMIT}× eqx.filter_jit on every row."
    )
    notes = [] if harness.optional_nnx() is not None else [harness.NO_FLAX]
    return harness.Section(
        "varying statics",
        header,
        harness.markdown_table(headers, table),
        targets,
        notes,
        ratios,
    )
