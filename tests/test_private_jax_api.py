"""The fence around JAX's private API (`filterjit._private_jax`): a canary test for each
private access, which fails when JAX moves what filterjit reads, and the public
fallback that keeps working meanwhile; the trace levels the private reader tells
apart; and what filterjit must not do to JAX (start a backend on import, set off a
deprecation warning)."""

import collections
import functools
import os
import subprocess
import sys
import warnings

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import run_program, subprocess_env, traceback_frames
from jax import lax

import filterjit
from filterjit import _entry, _nested, _private_jax, _structure, _trace, _tracebacks
from filterjit._jax_jit import JitWrapper, level_switch as jit_level_switch
from filterjit._jit import FilterJitWrapper, level_switch
from filterjit._level import EAGER, STAGED, TOP


def test_private_api_is_available():
    # If this fails, JAX has moved `trace_ctx`, `EvalTrace`, `DynamicJaxprTrace`
    # or the `disable_jit` state: update filterjit/_private_jax.py. The fallback
    # keeps working meanwhile, but cannot tell eager transforms from the top level.
    assert _trace.private_api_available
    assert _trace.trace_level.__name__ == "_trace_level_private"
    assert _trace.level_reader.level_of is _trace._walk
    assert _trace.level_reader.top_type is _private_jax.EvalTrace
    # The hot path reads the state behind `trace_ctx.trace` directly (from jax 0.10,
    # `trace_state_strong_ref`; jax 0.9 keeps the trace in an attribute of
    # `trace_ctx`, read through a stand-in).
    from_attribute = type(_trace._current_trace).__name__ == "_TraceAttribute"
    assert from_attribute == (jax.__version_info__ < (0, 10))
    seen = []

    @jax.jit
    def f(x):
        seen.append(_trace._current_trace.value is _private_jax.trace_ctx.trace)
        return x

    f(1.0)
    assert seen == [True]
    assert _trace._current_trace.value is _private_jax.trace_ctx.trace


def test_the_states_are_read_by_their_getters():
    # If this fails, JAX's states no longer keep `value` in a property: the hot path
    # then reads `.value` (`operator.attrgetter`), a little more slowly.
    disable_jit, current_trace = _private_jax.disable_jit_state, _trace._current_trace
    assert _trace._disable_jit_value is type(disable_jit).value.fget
    assert _trace._current_trace_value is type(current_trace).value.fget
    reads = []

    @jax.jit
    def f(x):
        reads.append(_trace._current_trace_value(current_trace) is current_trace.value)
        return x

    f(1.0)
    for disabled in (False, True, False):
        with jax.disable_jit(disabled):
            value = _trace._disable_jit_value(disable_jit)
            assert value is disable_jit.value is disabled
            reads.append(
                _trace._current_trace_value(current_trace) is current_trace.value
            )
    assert reads == [True] * 4


def test_jit_cache_size_reads_jax_jits_cache():
    # If this fails, JAX's jitted object no longer has `_cache_size`: then
    # `num_traces` of a filterjit.jit function raises (the fallback).
    f = jax.jit(lambda x: x + 1)
    assert _nested.jit_cache_size(f) == 0
    f(1.0)
    f(jnp.ones(2))
    f(2.0)
    assert _nested.jit_cache_size(f) == 2
    assert _nested.jit_cache_size(lambda x: x) is None


def test_aux_data_reads_the_pickled_structure():
    # If this fails, JAX has changed what a PyTreeDef pickles: update
    # `_aux_data_private` in filterjit/_structure.py. The fallback (a walk with
    # `node_data()` and `children()`) keeps working meanwhile, more slowly.
    assert _structure.aux_data is _structure._aux_data_private
    Point = collections.namedtuple("Point", "x y")
    model = eqx.nn.MLP(2, 3, 4, 2, key=jax.random.key(0))
    for tree in [
        [{"b": 1, "a": (None, 2.0)}, Point(1, {3: 4}), ()],
        collections.OrderedDict(b=1, a=2),
        collections.defaultdict(int, {1.0: [1]}),
        jax.tree_util.Partial(len, 1),
        model,
        {"model": model, "opt": optax.adam(1e-3).init(eqx.filter(model, eqx.is_array))},
        1.0,
        None,
    ]:
        treedef = jax.tree_util.tree_structure(tree)
        private = _structure._aux_data_private(treedef)
        public = _structure._aux_data_public(treedef)
        assert len(private) == len(public)
        assert all(map(lambda a, b: a is b or a == b, private, public))


def test_block_leaves_is_jaxs_batched_wait():
    # If this fails, JAX has moved `xla_client.batched_block_until_ready`: update
    # `block_leaves` in filterjit/_trace.py. The fallback
    # (`jax.block_until_ready`) keeps working meanwhile, 3 µs slower per wait.
    assert _trace.block_leaves is not _trace._block_leaves_public
    # It waits, and raises a failed computation's error, as the fallback does.
    for block in (_trace.block_leaves, _trace._block_leaves_public):
        slow = jax.jit(lambda x: jnp.linalg.matrix_power(x, 64))(jnp.eye(200))
        block([slow, jnp.ones(2)])
        assert slow.is_ready()
        block([])

        def fail(x):
            raise RuntimeError("the callback failed")

        # (On CPU the call itself may raise: it runs where it has a callback.)
        with pytest.raises(Exception, match="the callback failed"):
            block([jax.jit(lambda x: jax.pure_callback(fail, x, x))(jnp.ones(2))])


def test_importing_filterjit_starts_no_backend():
    # A program (Equinox's own test suite, for one) may configure JAX's devices
    # after its imports: importing filterjit must not run anything on a device.
    # The CPU platform's devices, asked for by name: on a machine with a GPU,
    # `jax.devices()` lists the GPU's.
    code = (
        "import jax, filterjit\n"
        "jax.config.update('jax_num_cpu_devices', 2)\n"
        "assert len(jax.devices('cpu')) == 2, jax.devices('cpu')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )
    assert done.returncode == 0, done.stderr[-2000:]


# Run in a fresh interpreter: JAX's state before filterjit is imported, then after
# it is imported and its wrappers called at every level. Printed: what changed, and
# the rule tables seen (so that the comparison cannot pass by seeing none).
_JAX_BEFORE_AND_AFTER = """
import json, sys, types

import equinox  # filterjit's dependencies first: what they change is theirs
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive


def snapshot():
    # By identity: every attribute of JAX's modules and of the classes they define,
    # each entry of their tables keyed by primitive (a table of tables too) and
    # each primitive's attributes. By value: JAX's configuration.
    seen, tables, primitives, modules = {}, set(), set(), set()
    for name, module in list(sys.modules.items()):
        if name.partition(".")[0] not in ("jax", "jaxlib"):
            continue
        if not isinstance(module, types.ModuleType):
            continue
        modules.add(name)
        for attribute, value in list(vars(module).items()):
            seen[name, attribute] = value
            if isinstance(value, type) and value.__module__ == name:
                for member, inner in list(vars(value).items()):
                    seen[name, attribute, member] = inner
            if not isinstance(value, dict):
                continue
            inner = [(k, v) for k, v in list(value.items()) if isinstance(v, dict)]
            for where, table in [(attribute, value), *inner]:
                for key, rule in list(table.items()):
                    if isinstance(key, Primitive):
                        seen[name, where, key] = rule
                        tables.add(f"{name}.{attribute}")
                        primitives.add(key)
    for primitive in primitives:
        for attribute, value in vars(primitive).items():
            seen[primitive, attribute] = value
    return seen, dict(jax.config.values), tables, modules | primitives


def run(decorate):
    def f(x, n):
        return lax.fori_loop(0, n, lambda _, y: jnp.sin(y), x) * np.float32(2)

    g = decorate(f)
    x = jnp.ones(3)
    g(x, 2)
    jax.grad(lambda x: g(x, 2).sum())(x)
    jax.vmap(lambda x: g(x, 2))(jnp.ones((2, 3)))
    jax.jit(lambda x: g(x, 2))(x)
    jax.block_until_ready(g(x, 3))


run(lambda f: jax.jit(f, static_argnums=1))  # JAX's own state made once
before, config_before, tables, owners = snapshot()

import filterjit

run(filterjit.filter_jit)
run(lambda f: filterjit.jit(f, static_argnums=1))
after, config_after, _, _ = snapshot()
changed = [k for k in before if k not in after or after[k] is not before[k]]
# Added to what was there before (a module's attribute, a class member, a rule
# of a primitive); not a module imported since, nor a primitive made since.
added = [
    k for k in after
    if k not in before
    and k[0] in owners
    and not (isinstance(k[-1], Primitive) and k[-1] not in owners)
    and not isinstance(after[k], types.ModuleType)
]
config = [k for k in config_before if config_after.get(k) != config_before[k]]
print(json.dumps({
    "changed": list(map(repr, changed)),
    "added": list(map(repr, added)),
    "config": config,
    "tables": sorted(tables),
}))
"""


def test_importing_and_calling_filterjit_changes_nothing_of_jax(tmp_path):
    # JAX's rules (JVP, transpose, batching, lowering, partial evaluation, ...)
    # hold for every program in the process: filterjit reads them, never
    # replaces one, nor any function, class member or setting of JAX's.
    found = run_program(tmp_path, _JAX_BEFORE_AND_AFTER)
    assert found["changed"] == [] and found["added"] == [], found
    assert found["config"] == [], found["config"]
    for table in [
        "interpreters.ad.primitive_jvps",
        "interpreters.ad.primitive_transposes",
        "interpreters.batching.fancy_primitive_batchers",
        "interpreters.mlir._lowerings",
        "interpreters.partial_eval.partial_eval_jaxpr_custom_rules",
    ]:
        assert f"jax._src.{table}" in found["tables"], found["tables"]


def test_current_equations_reads_the_innermost_trace():
    # If this fails, JAX has moved the equations of a trace in progress
    # (`DynamicJaxprTrace.frame.get_eqns`): runtime checks (`eqx.error_if`) are
    # then assumed everywhere, and every top-level call waits for its result.
    assert _trace.current_equations.__name__ == "_current_equations_private"
    seen = []

    @jax.jit
    def f(x):
        y = jnp.sin(x) + 1
        seen.append([eqn.primitive.name for eqn in _trace.current_equations() or []])
        return y

    f(1.0)
    assert seen == [["sin", "add"]]
    assert _trace.current_equations() is None  # no staged trace


def test_the_loop_readers_read_the_trace_in_progress_and_the_loops_stack():
    # If this fails, JAX has moved a trace's inputs or the stack it records with an
    # equation: the note on the reverse-mode loop error names every traced scalar,
    # or is missing (tests/test_errors_in_user_code.py).
    seen = []

    def f(x, n):
        y = lax.fori_loop(0, n, lambda _, y: y * 2, x)
        (loop,) = _trace.current_equations() or []
        inputs = _trace.current_inputs() or []
        seen.append((loop.invars[1] is inputs[1], loop))
        return y

    jax.jit(f)(1.0, 3)
    ((same, loop),) = seen
    assert same
    functions = [frame.function for frame in _tracebacks.source_frames(loop)]
    assert "fori_loop" in functions and "scan" not in functions
    # Where: the line of the `fori_loop`.
    where = (f.__code__.co_filename, f.__code__.co_firstlineno + 1)
    assert where in {
        (frame.file, frame.line) for frame in _tracebacks.source_frames(loop)
    }
    assert _tracebacks.source_frames(None) == []
    assert _trace.current_inputs() is None  # no staged trace


def _levels_seen(run) -> list[int]:
    seen = []

    def probe(x):
        seen.append(_trace.trace_level())
        return x

    run(probe)
    return seen


@pytest.mark.parametrize(
    "run, expected",
    [
        (lambda p: p(1.0), TOP),
        (lambda p: jax.grad(p)(1.0), EAGER),
        (lambda p: jax.vjp(p, 1.0), EAGER),
        (lambda p: jax.jvp(p, (1.0,), (1.0,)), EAGER),
        (lambda p: jax.linearize(p, 1.0), EAGER),
        (lambda p: jax.vmap(p)(jnp.ones(2)), EAGER),
        (lambda p: jax.jit(p)(1.0), STAGED),
        (lambda p: jax.make_jaxpr(p)(1.0), STAGED),
        (lambda p: jax.eval_shape(p, 1.0), STAGED),
        (lambda p: jax.checkpoint(p)(1.0), STAGED),
        (
            lambda p: lax.scan(lambda c, _: (p(c), None), 1.0, None, length=1),
            STAGED,
        ),
        (lambda p: lax.cond(True, p, p, 1.0), STAGED),
        (lambda p: jax.jit(jax.grad(p))(1.0), STAGED),
        (lambda p: jax.grad(jax.checkpoint(p))(1.0), STAGED),
    ],
)
def test_trace_level(run, expected):
    assert set(_levels_seen(run)) == {expected}


@pytest.mark.skipif(
    not hasattr(jax.extend.core, "unsafe_am_i_under_a_jit_DO_NOT_USE"),
    reason="this jax has no public fallback for trace detection",
)
def test_fallback_keeps_the_nested_contract(monkeypatch):
    # Simulate a JAX that moved the private API: the public fallback must still
    # keep nested calls no-ops.
    monkeypatch.setattr(_trace, "trace_level", _trace._trace_level_public)
    monkeypatch.setattr(JitWrapper, "__call__", jit_level_switch(_trace.PUBLIC_READER))
    # filter_jit's wrapper took its `__call__` when its class was made.
    public = level_switch(_trace.PUBLIC_READER)
    monkeypatch.setattr(FilterJitWrapper, "__call__", public)

    def loop(init, lower):
        return lax.fori_loop(lower, 1, lambda _, y: y + 1, init)

    for f in (filterjit.filter_jit(loop), filterjit.jit(loop)):
        assert jax.jit(lambda: jax.grad(f)(0.0, np.int32(0)))() == 1.0
        assert f(jnp.float32(1.0), 0) == 2.0
    # filterjit.jit is jax.jit under eager transforms: `lower` is traced there.
    with pytest.raises(ValueError, match="Reverse-mode differentiation"):
        jax.grad(filterjit.jit(loop))(0.0, np.int32(0))
    with jax.disable_jit():
        assert filterjit.filter_jit(loop)(jnp.float32(1.0), 0) == 2.0


def test_no_deprecation_warning():
    @filterjit.filter_jit
    def f(x, n):
        return x * n

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(jnp.ones(2), 2.0)
        jax.jit(lambda x: f(x, np.float32(2)))(jnp.ones(2))
        jax.grad(lambda x: f(x, 2.0).sum())(jnp.ones(2))


def test_traceback_filtering_private_api_is_available():
    # If this fails, JAX has moved what `jax._src.traceback_util.api_boundary` uses
    # (`_filtering_mode`, `filter_traceback`, `_is_under_reraiser`, ...): update
    # `hide_frames` in filterjit/_tracebacks.py. Meanwhile tracebacks hold filterjit's
    # frames above `jax.jit`'s boundary (the fallback leaves them whole).
    assert _tracebacks.traceback_filtering_available
    assert _tracebacks.hide_frames is _tracebacks.hide_frames_private
    from jax._src import traceback_util

    # Frames under the package's directory (generated code included) are JAX's
    # to leave out below its own boundary too.
    assert _tracebacks.package_dir in traceback_util._exclude_paths
    generated = os.path.join(_tracebacks.package_dir, "<generated top 0>")
    assert not traceback_util.include_filename(generated)


def test_traceback_fallback_leaves_the_traceback_whole(monkeypatch):
    # Simulate a JAX that moved its traceback filtering: the error is raised as it
    # was, with filterjit's frames in its traceback.
    monkeypatch.setattr(_tracebacks, "hide_frames", _tracebacks.hide_frames_public)

    @filterjit.filter_jit
    def f(a, b):
        return a @ b

    with pytest.raises(TypeError, match="dot_general requires") as info:
        f(jnp.ones((2, 3)), jnp.ones((4, 5)))
    files = [frame.f_code.co_filename for frame in traceback_frames(info.value)]
    assert any(name.startswith(_tracebacks.package_dir + os.sep) for name in files)
    monkeypatch.undo()
    with pytest.raises(TypeError, match="dot_general requires") as info:
        f(jnp.ones((2, 3)), jnp.ones((4, 5)))
    files = [frame.f_code.co_filename for frame in traceback_frames(info.value)]
    assert not any(name.startswith(_tracebacks.package_dir + os.sep) for name in files)


def test_boxed_partial_reads_jaxs_box():
    # If this fails, JAX has moved or changed `_HashableCallableShim`, the box that
    # `jtu.Partial(partial)` puts a partial in: update filterjit/_trace.py. The
    # fallback holds such a `jtu.Partial` as it is (its partial auxiliary data).
    assert _trace.boxed_partial.__name__ == "_boxed_partial_private"
    table = {"k": 3.0}
    inner = functools.partial(_lookup, table, scale=2.0)
    outer = jax.tree_util.Partial(inner, 1.0)
    unboxed = _trace.boxed_partial(outer.func)
    assert type(unboxed) is functools.partial
    assert unboxed.func is _lookup and unboxed.args == (table,)
    assert unboxed.keywords == {"scale": 2.0}
    assert _trace.boxed_partial(_lookup) is None
    assert _trace._boxed_partial_public(outer.func) is None


def test_a_nested_calls_constants_are_operands_of_its_equation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # If this fails, JAX has moved `_infer_params`, `jit_p`, `separate_consts` or
    # what a `jax.jit` object holds: update `nested_caller_private` in
    # filterjit/_nested.py. The fallback calls the `jax.jit` object, whose jaxpr keeps
    # the arrays a call captured as constants of its own, which a `cond` under
    # `vmap` does not batch (a `jax.debug.callback` on them then runs once, where
    # undecorated it runs per element: tests/test_fuzz_programs.py).
    assert _nested.nested_caller is _nested.nested_caller_private
    table = np.arange(3.0, dtype=np.float32)

    def equation() -> tuple[int, int]:
        """A nested call's equation: its jaxpr's constants, and its operands."""
        scaled = filterjit.filter_jit(lambda x, t: x * t)
        (eqn,) = jax.make_jaxpr(lambda x: scaled(x, table))(jnp.ones(3)).eqns
        assert jax.jit(lambda x: scaled(x, table))(jnp.ones(3)).tolist() == [0, 1, 2]
        return len(eqn.params["jaxpr"].consts), len(eqn.invars)

    assert equation() == (0, 2)
    monkeypatch.setattr(_entry, "nested_caller", _nested.nested_caller_public)
    assert equation() == (1, 1)


def _lookup(table: dict[str, float], x: float, scale: float = 1.0) -> float:
    return table["k"] * x * scale
