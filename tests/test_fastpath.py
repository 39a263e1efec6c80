"""The fast path against the reference path (`filterjit/_fastpath.py`).

A stateful property test runs each call of a generated sequence through a wrapper
(fast path), its reference twin (every call on the reference path) and the
undecorated function, at the top level, under `jax.grad` and `jax.vmap`, and nested
in `jax.jit` and `lax.scan`; between calls, Modules are changed in place (with
`object.__setattr__` and through `__dict__`), containers and defaults too, wrappers
made anew, x64 toggled and caches cleared. Where the fast path reads a call, its
leaves and key must be the reference path's; results and errors must agree with
each other and with the undecorated function.

`FILTERJIT_SOAK=N` runs N random examples (see `helpers.property_settings`).
"""

import collections
import dataclasses
import os
import subprocess
import sys
from typing import Any

import differential
import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from differential import assert_agree, assert_tree_allclose, needs_fast_path, outcome
from helpers import (
    fast_read,
    property_settings,
    reference_read,
    reference_twin,
    subprocess_env,
)
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule, RuleBasedStateMachine

import filterjit
from filterjit import _dispatch, _trace, filter_jit


pytestmark = needs_fast_path


class Affine(eqx.Module):
    w: jax.Array
    b: float
    k: float = eqx.field(static=True)

    def __call__(self, x, n=1):
        return self.w * x * n + self.b * self.k


Pair = collections.namedtuple("Pair", "n x")
SCALE = [2.0]  # a mutable default, changed in place by the state machine


def plain(x, n):
    return x * n, n


def defaults(x, n=2, *, scale=SCALE):
    return x * scale[0] + n, scale[0]


def module(m, x):
    return m(x), m.k


def tree(t, x):
    leaves = jax.tree_util.tree_leaves(t)
    total = x
    for leaf in leaves:
        total = total + leaf
    return total, list(t) if isinstance(t, dict) else len(t)


def keywords(x, **kw):
    total = x
    for value in kw.values():
        total = total * value
    return total, list(kw)


def raises(x, n):
    if n == 3:
        raise ValueError("three is refused")
    return x + n


def made(x, n):
    # A static output the trace makes, not `n` itself: the hit builds one inline.
    return x * n, f"{type(n).__name__} {n!r} {x.dtype}"


FUNCTIONS = {
    "plain": plain,
    "made": made,
    "defaults": defaults,
    "module": module,
    "tree": tree,
    "keywords": keywords,
    "raises": raises,
}
# The harness's contexts: the top level, eager transforms, and nested.
WHERE = {
    c.name: c
    for c in differential.contexts("top level", "grad", "vmap", "jit", "scan body")
}
STATICS = [2, 3, 2.0, -0.0, True]


def _first_array(out):
    return next(
        leaf for leaf in jax.tree_util.tree_leaves(out) if isinstance(leaf, jax.Array)
    )


class FastAgainstReference(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        jax.config.update("jax_enable_x64", False)
        SCALE[0] = 2.0
        self.modules = [Affine(jnp.ones(3), 1.0, 2.0), Affine(jnp.ones(3), 0.5, 1)]
        self.containers = [[jnp.ones(3), 1.0], {"b": jnp.ones(3), "a": 2}]
        self.wrappers = {name: self._wrap(fun) for name, fun in FUNCTIONS.items()}
        self.reads = 0

    def _wrap(self, fun) -> tuple[Any, Any]:
        fast = filter_jit(fun)
        return fast, reference_twin(fast)

    def _probe(self, dispatcher):
        def probe(fun, args, kwargs):
            level = _trace.trace_level()
            found = fast_read(dispatcher, level, fun, args, kwargs)
            if found is None:
                return
            partition, leaves, key = found
            ref_partition, ref_leaves, ref_key = reference_read(
                dispatcher, level, fun, args, kwargs
            )
            assert partition is ref_partition
            assert len(leaves) == len(ref_leaves)
            assert all(a is b for a, b in zip(leaves, ref_leaves))
            assert key == ref_key
            self.reads += 1

        return probe

    @rule(
        name=st.sampled_from(sorted(FUNCTIONS)),
        where=st.sampled_from(sorted(WHERE)),
        static=st.sampled_from(STATICS),
        size=st.sampled_from([3, 2]),
        index=st.integers(0, 1),
        keyword=st.booleans(),
    )
    def call(self, name, where, static, size, index, keyword):
        if name in ("module", "tree"):
            size = 3  # as the Modules' and containers' arrays
        module, container = self.modules[index], self.containers[index]

        def arguments(x):
            if name == "defaults":
                return (x,), ({"n": static} if keyword else {})
            if name == "module":
                return (module, x), {}
            if name == "tree":
                return (container, x), {}
            if name == "keywords":
                return (x,), ({"p": static, "q": 2} if keyword else {"q": static})
            return (x, static), {}

        fast, twin = self.wrappers[name]
        probe = self._probe(fast._dispatcher)

        def call_fast(x):
            args, kwargs = arguments(x)
            probe(fast._fun, args, kwargs)
            return fast(*args, **kwargs)

        def calling(fun, rebuilt=False):
            def call(x):
                args, kwargs = arguments(x)
                if rebuilt:  # as jax.jit passes them: dicts in JAX's order
                    args = jax.tree_util.tree_map(lambda leaf: leaf, args)
                return fun(*args, **kwargs)

            return call

        x = jnp.arange(float(size))
        context = WHERE[where]
        fast_outcome, twin_outcome, reference = [
            outcome(lambda: differential.run_in(context, call, x), raises=[ValueError])
            for call in (
                call_fast,
                calling(twin),
                # The top level is jax.jit's; nested, the function's own.
                calling(FUNCTIONS[name], rebuilt=not context.staged),
            )
        ]
        assert_agree(fast_outcome, twin_outcome, messages=True)
        assert_agree(fast_outcome, reference, messages=True)

    @rule(index=st.integers(0, 1), how=st.sampled_from(["setattr", "dict"]))
    def change_module(self, index, how):
        m = self.modules[index]
        w = m.w + 1
        if how == "setattr":
            object.__setattr__(m, "w", w)
        else:
            vars(m)["w"] = w
        object.__setattr__(m, "b", m.b + 1.0)

    @rule(index=st.integers(0, 1), value=st.sampled_from([1, 2.5, -0.0]))
    def change_container(self, index, value):
        container = self.containers[index]
        if isinstance(container, list):
            container[1] = value
        else:
            container["a"] = value

    @rule(value=st.sampled_from([1.0, 3.0, -0.0, 2]))
    def change_default(self, value):
        SCALE[0] = value

    @rule(name=st.sampled_from(sorted(FUNCTIONS)))
    def new_wrapper(self, name):
        self.wrappers[name] = self._wrap(FUNCTIONS[name])

    @rule()
    def toggle_x64(self):
        jax.config.update("jax_enable_x64", not jax.config.read("jax_enable_x64"))

    @rule()
    def clear_caches(self):
        filterjit.clear_caches()

    def teardown(self):
        jax.config.update("jax_enable_x64", False)
        SCALE[0] = 2.0


FastAgainstReference.TestCase.settings = property_settings(compiled=True)
test_fast_path_against_reference_path = FastAgainstReference.TestCase


def _levels_of(call):
    """`call()` at the top level, under `jax.grad` and nested in `jax.jit`."""
    call()
    jax.grad(lambda x: jnp.sum(_first_array(call(x))))(jnp.arange(3.0))
    jax.jit(lambda x: _first_array(call(x)))(jnp.arange(3.0))


def _count_reference_calls(monkeypatch) -> list[None]:
    """A list that grows by one on each call of the reference path."""
    calls: list[None] = []
    reference = _dispatch.Dispatcher.call

    def counted(self, *args, **kwargs):
        calls.append(None)
        return reference(self, *args, **kwargs)

    monkeypatch.setattr(_dispatch.Dispatcher, "call", counted)
    return calls


@pytest.mark.parametrize("name", ["plain", "defaults", "module", "keywords"])
def test_call_takes_the_fast_path_where_fast_read_says(monkeypatch, name):
    """What `helpers.fast_read` reads, the wrapper's hit serves without the
    reference path, and with the key the reference path makes."""
    # From empty caches: the state machine above shares these functions' dispatcher,
    # and a partition it left behind reads a call whose entry it never made.
    filterjit.clear_caches()
    wrapper: Any = filter_jit(FUNCTIONS[name])
    dispatcher = wrapper._dispatcher
    m = Affine(jnp.ones(3), 1.0, 2.0)
    arguments = {
        "plain": lambda x: ((x, 2), {}),
        "defaults": lambda x: ((x,), {"n": 3}),
        "module": lambda x: ((m, x), {}),
        "keywords": lambda x: ((x,), {"p": 2.0}),
    }[name]
    reference_calls = _count_reference_calls(monkeypatch)
    fast_reads = []

    def call(x=None):
        x = jnp.arange(3.0) if x is None else x
        args, kwargs = arguments(x)
        level = _trace.trace_level()
        found = fast_read(dispatcher, level, wrapper._fun, args, kwargs)
        if found is not None:
            assert (
                found[2]
                == reference_read(dispatcher, level, wrapper._fun, args, kwargs)[2]
            )
            fast_reads.append(level)
        before = len(reference_calls)
        out = wrapper(*args, **kwargs)
        if found is not None:
            assert len(reference_calls) == before  # served by the fast path
        return out

    for _ in range(2):
        _levels_of(call)
    levels = set(fast_reads)
    assert _trace.TOP in levels and _trace.EAGER in levels
    if name in ("plain", "module"):  # nested, calls that need no binding
        assert _trace.STAGED in levels


def _hit_functions(call):
    """The names of filterjit's Python functions (generated code included) that
    a warm hit runs, with `sys.setprofile`."""
    package = os.path.dirname(filterjit.__file__)
    call()
    call()
    names = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            names.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return names


class _Tag:
    """A tag compared by identity, as lineax's are."""


_SYMMETRIC, _DIAGONAL = _Tag(), _Tag()


class Tagged(eqx.Module):
    w: jax.Array
    tags: frozenset[object] = eqx.field(static=True)


@pytest.mark.skipif(not _trace.private_api_available, reason="the public fallback")
def test_a_warm_hit_runs_few_of_filterjits_functions():
    """2 for a plain function, 3 for a Module method and 3 nested: the wrapper's
    `__call__` (after the method's `__get__`) and the generated hit, which reads,
    keys, runs and builds the output (nested, handing the entry the call's pytree,
    as `_entry.run_nested`); nested, the entry's caller, which moves the trace's
    constants to the operands (`_nested.nested_caller`); nothing of the
    dispatcher's."""
    x = jnp.ones(3)
    g = filter_jit(raises)  # `x + n`: arrays out
    plain_hit = _hit_functions(lambda: g(x, 2))
    # Under JAX 0.9, the innermost trace is read through a property of filterjit's
    # (`_trace._TraceAttribute.value`): a function more, in the level check.
    reader = _hit_functions(_trace.level_reader.current)
    assert plain_hit == ["__call__", *reader, "hit"] and len(reader) <= 1, plain_hit
    # A static output, handed back or made from the traced leaves alone, is built
    # inside the hit (see the test below).
    static = filter_jit(plain)
    static_hit = _hit_functions(lambda: static(x, 2))
    assert static_hit == plain_hit, static_hit
    made = filter_jit(lambda x, n: (x * n, "made"))
    assert _hit_functions(lambda: made(x, 2)) == plain_hit

    class Scaled(eqx.Module):
        w: jax.Array

        @filter_jit
        def __call__(self, x, n):
            return self.w * x * n

    m = Scaled(jnp.ones(3))
    method_hit = _hit_functions(lambda: m(x, 2))
    assert method_hit == ["__get__", *plain_hit], method_hit
    # A Module's static fields holding the objects the trace was keyed with (a
    # frozenset of tags, as `lineax`'s operators hold) are settled by identity.
    tagged = filter_jit(lambda op, x: op.w * x)
    operator = Tagged(jnp.ones(3), frozenset({_SYMMETRIC, _DIAGONAL}))
    assert _hit_functions(lambda: tagged(operator, x)) == plain_hit
    nested_hit = []

    @jax.jit
    def outer(x):
        nested_hit.extend(_hit_functions(lambda: g(x, 2)))
        return x

    outer(x)
    assert nested_hit == [*plain_hit, "call_nested"], nested_hit
    assert len(set(plain_hit + method_hit + nested_hit)) == len(
        set(plain_hit) | set(method_hit) | set(nested_hit)
    )


def _inline_or_built(x, n):
    # Static outputs made by the trace from the traced leaves alone (none is `n`
    # itself): a tuple and a dict, which a hit may build inline, and a namedtuple,
    # which it may not.
    if n == 2:
        return x * n, "two"
    if n == 3:
        return {"y": x * n, "n": ["three", None]}
    return Pair("four", x)


@pytest.mark.skipif(not _trace.private_api_available, reason="the public fallback")
def test_top_builds_inline_only_the_output_of_the_trace_it_learned():
    # The hit is made again on the reference path alone, after a run whose trace's
    # plain output is new to the partition, from a plan holding that trace's spec,
    # and builds that very trace's output inline (`s is` its spec) where it can;
    # a spec it holds not, or cannot write, builds the output itself.
    g = filter_jit(_inline_or_built)
    dispatcher = g._dispatcher
    x = jnp.arange(2.0)
    seen, made = set(), []
    for n in [4, 4, 4, 2, 2, 3, 3, 2, 4, 3, 2, 4]:
        hit = dispatcher.hits[_trace.TOP]
        assert_tree_allclose(g(x, n), _inline_or_built(x, n))
        # Made again on a new trace only (no code is written on a hit).
        assert (dispatcher.hits[_trace.TOP] is hit) == (n in seen), n
        seen.add(n)
        made.append(dispatcher.hits[_trace.TOP])
    (route,) = dispatcher.routes[_trace.TOP].values()
    assert made[-1] is route.hit and len(route.learned) == 3
    for n in [2, 3]:  # a tuple and a dict, written inline
        hit = _hit_functions(lambda: g(x, n))
        assert hit[-1] == "hit" and "build" not in hit, hit
    # A namedtuple is not written inline: its spec's `unflatten`.
    assert "<lambda>" in _hit_functions(lambda: g(x, 4))
    assert "hit_caller" not in _hit_functions(lambda: g(x, 2))


@needs_fast_path
def test_a_route_is_replaced_whole_never_changed():
    # What a call teaches a route (a new shape of call) makes a new route in its
    # place; the one a plan was made from holds what it held.
    def scaled(x, scale=2.0):
        return x * scale

    g = filter_jit(scaled)
    routes = g._dispatcher.routes[_trace.TOP]
    x = jnp.arange(2.0)
    g(x)
    (first,) = routes.values()
    calls, hit = dict(first.calls), first.hit
    assert hit is not None and list(calls) == [(1,)]
    assert_tree_allclose(g(x, scale=3.0), scaled(x, scale=3.0))
    (second,) = routes.values()
    assert second is not first and second.key is first.key
    assert dict(first.calls) == calls and first.hit is hit
    assert list(second.calls) == [(1,), (1, "scale")] and second.hit is not hit
    with pytest.raises(dataclasses.FrozenInstanceError):
        second.hit = None  # pyright: ignore[reportAttributeAccessIssue]


def test_a_hit_builds_a_bounded_number_of_outputs_inline():
    # The first `_MAX_LEARNED` plain outputs' specs of a partition; the outputs of
    # later traces are built by their own specs, and the hit is no longer made
    # again for them.
    def tagged(x, n):
        return x * n, f"tag {n}"

    g = filter_jit(tagged)
    x = jnp.arange(2.0)
    count = _dispatch._MAX_LEARNED + 2
    for n in [*range(count), *range(count)]:
        assert_tree_allclose(g(x, n), tagged(x, n))
    (route,) = g._dispatcher.routes[_trace.TOP].values()
    assert len(route.learned) == _dispatch._MAX_LEARNED
    for n in range(count):
        hit = _hit_functions(lambda: g(x, n))
        inline = n < _dispatch._MAX_LEARNED
        assert (hit[-1] == "hit") == inline and ("<lambda>" in hit) != inline, hit


def test_the_environment_turns_the_fast_path_off():
    code = """
import jax.numpy as jnp
from filterjit import _fastpath, filter_jit

g = filter_jit(lambda x, n=2, *, k=1.0: x * n * k)
for _ in range(3):
    g(jnp.ones(3), 3)
    g(jnp.ones(3), k=2.0)
d = g._dispatcher
assert not _fastpath.ENABLED and all(hit is _fastpath.miss for hit in d.hits)
for cache in d.routes:
    for route in cache._values.values():
        assert route.hit is None and not route.calls
print("reference path only")
"""
    env = subprocess_env(FILTERJIT_FASTPATH="0")
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "reference path only" in done.stdout


def test_the_library_entry_points_take_the_fast_path(monkeypatch):
    """diffrax, optimistix and lineax as their users call them (keyword arguments,
    Modules, sentinel defaults): after the first call, every call is read and
    keyed by the fast path."""
    diffrax = pytest.importorskip("diffrax")
    optimistix = pytest.importorskip("optimistix")
    lineax = pytest.importorskip("lineax")
    reference_calls = _count_reference_calls(monkeypatch)
    y0 = jnp.ones(4)
    term = diffrax.ODETerm(lambda t, y, a: -a * y)  # made once, as users do

    def fn(y, a):
        return y**3 + y - a

    calls = {
        "diffeqsolve": lambda f: f(
            term,
            diffrax.Tsit5(),
            t0=0.0,
            t1=1.0,
            dt0=0.1,
            y0=y0,
            args=2.0,
            saveat=diffrax.SaveAt(t1=True),
        ),
        "root_find": lambda f: f(
            fn,
            optimistix.Newton(rtol=1e-6, atol=1e-6),
            y0,
            args=y0,
        ),
        "linear_solve": lambda f: f(
            lineax.MatrixLinearOperator(2.0 * jnp.eye(4)), y0, solver=lineax.LU()
        ),
    }
    entry_points = {
        "diffeqsolve": diffrax.diffeqsolve,
        "root_find": optimistix.root_find,
        "linear_solve": lineax.linear_solve,
    }
    for name, call in calls.items():
        wrapper = filter_jit(entry_points[name].__wrapped__)
        call(wrapper)
        before = len(reference_calls)
        for _ in range(3):
            call(wrapper)
        assert len(reference_calls) == before, name


# What `_Scaled` and `_undocumented` were traced (or run) with.
_TRACED: list[Any] = []


class _Scaled(eqx.Module):
    """A layer with a static field left at its default, `None`."""

    weight: jax.Array
    activation: Any = eqx.field(static=True, default=None)

    def __call__(self, x):
        _TRACED.append(x)
        y = x * self.weight
        return y if self.activation is None else self.activation(y)


def _undocumented(x):
    _TRACED.append(x)
    return jnp.tanh(x) * 2


@needs_fast_path
@pytest.mark.parametrize(
    "pattern", ["int / float", "None / mask", "True / False", "vmap anew", "model anew"]
)
def test_calls_whose_static_inputs_vary_stay_on_the_fast_path(monkeypatch, pattern):
    """Calls alternating between partitions (a static value's type, an optional
    argument, a flag), and wrappers made anew at every call (`filter_jit` of an
    `eqx.filter_vmap` wrapper, of a Module rebuilt by `eqx.tree_at`), are served
    by the fast path once each partition was called twice, with the results of
    the undecorated function and one trace per partition."""
    x = jnp.linspace(-1.0, 1.0, 4)
    traces = _TRACED
    traces.clear()

    def scale(x, k):
        traces.append(k)
        return x * k + 1

    def masked(x, mask):
        traces.append(mask is None)
        y = jnp.tanh(x)
        return y if mask is None else jnp.where(mask, y, 0.0)

    def mode(x, training):
        traces.append(training)
        return jnp.tanh(x) * 0.9 if training else jnp.tanh(x)

    model = _Scaled(jnp.ones(4))

    def next_model():
        nonlocal model
        model = eqx.tree_at(lambda m: m.weight, model, model.weight + 1.0)
        return model

    xs = jnp.stack([x, x * 2])

    def plain(wrapper, fun, *args):
        return lambda: (wrapper, fun, args)

    def vmap_anew():
        fun = eqx.filter_vmap(_undocumented)
        return filter_jit(fun), fun, (xs,)

    def model_anew():
        m = next_model()
        return filter_jit(m), m, (x,)

    scaled, masks, modes = filter_jit(scale), filter_jit(masked), filter_jit(mode)
    step = {
        "int / float": [plain(scaled, scale, x, 2), plain(scaled, scale, x, 2.0)],
        "None / mask": [plain(masks, masked, x, None), plain(masks, masked, x, x > 0)],
        "True / False": [plain(modes, mode, x, True), plain(modes, mode, x, False)],
        "vmap anew": [vmap_anew],
        "model anew": [model_anew],
    }[pattern]
    reference_calls = _count_reference_calls(monkeypatch)
    for _ in range(2):  # each partition traced, then its hit made
        for make in step:
            wrapper, fun, args = make()
            wrapper(*args)
    before, traced = len(reference_calls), len(traces)
    for _ in range(3):
        for make in step:
            wrapper, fun, args = make()
            assert_tree_allclose(wrapper(*args), fun(*args))
    assert len(reference_calls) == before
    assert len(traces) == traced + 3 * len(step)  # the undecorated calls alone


@needs_fast_path
@pytest.mark.parametrize("length", [6, 100])
def test_a_static_tuple_keys_as_its_items_whatever_the_hit_remembers(
    monkeypatch, length
):
    """A hit remembers the key of the last tuple of floats it read (its items
    cannot change): tuples equal by `==` that trace differently (`0.0` and `-0.0`)
    and passed in turn keep their own traces, and an equal tuple made anew shares
    one, on the fast path, with the results of the undecorated function."""
    traces = []

    def signed(x, table):
        traces.append(table)
        return x * jnp.copysign(1.0, table[0]) + table[-1]

    rest = tuple(float(i) for i in range(1, length))
    positive, negative = (0.0, *rest), (-0.0, *rest)
    f, x = filter_jit(signed), jnp.ones(2)
    for table in (positive, negative, positive, negative):
        f(x, table)
    reference_calls = _count_reference_calls(monkeypatch)
    for table in (positive, negative, (0.0, *rest), negative, (-0.0, *rest)):
        assert_tree_allclose(f(x, table), signed(x, table))
    assert not reference_calls
    assert filterjit.num_traces(f) == 2
