"""Shared test utilities."""

import json
import os
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import jax
import pytest
from hypothesis import HealthCheck, settings


ROOT = Path(__file__).resolve().parent.parent

# On a TPU machine JAX warns at import in every process, whatever its platform
# (its start-up looks at the hardware): that is not the code under test, so a
# child run with warnings as errors tolerates it.
BACKEND_START_UP_WARNINGS = "ignore::UserWarning:jax._src.cloud_tpu_init"
# A child Python's flags for warnings as errors.
WARNINGS_AS_ERRORS = ("-W", "error", "-W", BACKEND_START_UP_WARNINGS)


def one_device_sharding(device: Any) -> jax.sharding.Sharding:
    """A sharding on one device, made as the installed JAX asks.

    JAX 0.12.1 deprecates constructing `SingleDeviceSharding` directly in favour of
    `make_single_device_sharding`, which JAX 0.9 lacks.
    """
    make = getattr(jax.sharding, "make_single_device_sharding", None)
    if make is None:
        return jax.sharding.SingleDeviceSharding(device)
    return make(device)


def subprocess_env(*paths: Path, **variables: str) -> dict[str, str]:
    """This process's environment, with `variables` set, for a Python subprocess
    that imports this checkout's filterjit (whatever is installed) and then `paths`."""
    env = {**os.environ, **variables}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *map(str, paths), *filter(None, [env.get("PYTHONPATH")])]
    )
    return env


def run_program(
    tmp_path: Path,
    source: str,
    modules: dict[str, str] | None = None,
    args: tuple[str, ...] | list[str] = (),
) -> Any:
    """Runs `source` with `args` in a fresh interpreter in `tmp_path`, with filterjit
    from this checkout and `modules` (name -> source) importable, and returns its
    last line, as JSON."""
    for name, text in (modules or {}).items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text), encoding="utf-8")
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(source), encoding="utf-8")
    env = subprocess_env(tmp_path)
    env.setdefault("JAX_PLATFORMS", "cpu")
    result = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def traceback_frames(error: BaseException) -> list[types.FrameType]:
    """The frames of `error`'s traceback, outermost first."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


class TraceCounter:
    """Wraps a function and counts how often its Python body runs."""

    def __init__(self, fun: Callable[..., Any]):
        self.fun = fun
        self.count = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.count += 1
        return self.fun(*args, **kwargs)


def jit_equation_count(jaxpr: Any) -> int:
    """Number of top-level `jit` equations in a (closed) jaxpr."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return sum(eqn.primitive.name == "jit" for eqn in jaxpr.eqns)


def cpp_cache_size(wrapped: Any) -> int:
    """Executables in JAX's C++ dispatch cache over all entries of a `filter_jit`
    wrapper's top level: a call that leaves the C++ fast path adds none. (Reads
    JAX's private `_cache_size`; tests only.)"""
    entries = wrapped._dispatcher.entries[0]._values.values()
    return sum(getattr(e.jitted, "func", e.jitted)._cache_size() for e in entries)


# Examples per property test whose every example traces and compiles, in the
# default tier; the full tier runs the profile's (tests/conftest.py).
COMPILED_DEFAULT_EXAMPLES = 5


def _full_tier() -> bool:
    current = getattr(settings, "get_current_profile_name", None)
    name = current() if current is not None else settings._current_profile
    return name == "filterjit-full"


def property_settings(
    share: float = 1.0,
    compiled: bool = False,
    most: int | None = None,
    fixtures: bool = False,
) -> settings:
    """Settings for the property tests: `share` of the active profile's examples
    (tests/conftest.py: 25 in the default tier, 200 with --full), or, for a test
    whose examples each compile (`compiled`), of 5 in the default tier; at most
    `most`; derandomized, so that CI runs the same examples every time. Or a random
    soak of FILTERJIT_SOAK examples. `fixtures`: the test takes function-scoped
    fixtures, which run once per test, not per example (what they set holds for
    all)."""
    soak = int(os.environ.get("FILTERJIT_SOAK", "0"))
    examples = settings().max_examples
    if compiled and not _full_tier():
        examples = COMPILED_DEFAULT_EXAMPLES
    examples = max(1, round(examples * share))
    if most is not None:
        examples = min(examples, most)
    checks = [HealthCheck.too_slow, HealthCheck.data_too_large]
    if fixtures:
        checks.append(HealthCheck.function_scoped_fixture)
    return settings(
        max_examples=soak or examples,
        derandomize=not soak,
        deadline=None,
        suppress_health_check=checks,
    )


def reference_twin(wrapper: Any) -> Any:
    """A wrapper of what `wrapper` wraps, with its options, made as `filter_jit`
    makes one, but whose calls all take the reference path: a dispatcher of its
    own, made with the fast path off."""
    from filterjit import _jit
    from filterjit._dispatch import Dispatcher

    def reference_dispatcher(fun: Any, options: Any, by_class: bool) -> Any:
        return Dispatcher(fun, options, fast=False)

    with mock.patch.object(_jit, "dispatcher_for", reference_dispatcher):
        return type(wrapper)(wrapper._fun, wrapper._options)


class _Read(Exception):
    """What a hit read of a call, raised where it would run it."""

    def __init__(self, leaves: list[Any] | None, dynamic: tuple[Any, ...]):
        super().__init__()
        self.leaves = leaves
        self.dynamic = dynamic


def fast_read(dispatcher: Any, level: int, fun: Any, args: Any, kwargs: Any) -> Any:
    """The partition, leaves and key that the hit at `level` reads of a call, or
    `None` where it leaves the call to the reference path: the hit made again from
    what its route holds, with a lookup that finds an entry whose run raises what
    it was given, so that nothing is run or stored. `test_fastpath.py` checks that
    the wrapper does as this says."""
    from filterjit._entry import CallUnderWay, Entry
    from filterjit._fastpath import hit_caller, MISS
    from filterjit._level import STAGED

    routes = dispatcher.routes[level].values()
    found = [route for route in routes if route.hit is dispatcher.hits[level]]
    if not found:
        return None
    (route,) = found
    partition = route.partition
    keys = []

    def jitted(*arguments: Any) -> None:  # nested, run with the call under way
        if arguments and type(arguments[0]) is CallUnderWay:
            call, *dynamic = arguments
            assert (call.under_way is not None) == (level == STAGED)
            leaves = None if call.under_way is None else call.under_way[1]
            raise _Read(leaves, tuple(dynamic))
        raise _Read(None, arguments)

    entry = Entry(jitted, [], False)  # unguarded, no constants

    def get(key: Any) -> Any:
        keys.append(key)
        return entry

    failed: list[list[Any]] = []  # the leaves of the run that raised
    plan = dispatcher.plan_of(route, get)
    hit = hit_caller(plan._replace(failed=lambda leaves, _: failed.append(leaves)))
    if hit is None:
        # Made as the route's was, it reads no call as things are now: a mutable
        # default, read when a hit is made, holds a leaf of another type now (the
        # route's hit reads the default on every call, and misses too).
        return None
    try:
        out = hit(fun, args, kwargs)
    except _Read as read:  # nested: raised as it was
        leaves, dynamic = read.leaves, read.dynamic
    else:
        assert out is MISS, out  # else the entry's run raised
        return None
    if leaves is None:  # at the top level, the leaves the hit read for the run
        (leaves,) = failed
    expected = partition.take_dynamic(leaves)
    assert len(dynamic) == len(expected)
    assert all(a is b for a, b in zip(dynamic, expected))
    return partition, leaves, keys[-1]


def reference_read(
    dispatcher: Any, level: int, fun: Any, args: Any, kwargs: Any
) -> Any:
    """The partition, leaves and key that the reference path makes of a call,
    changing nothing."""
    function = dispatcher.function
    tree = function.call_tree(fun, *function.bind(args, kwargs))
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    route, _, key, _ = dispatcher._lookup(level, fun, tree, leaves, treedef, None)
    return route.partition, leaves, key


def _each_path(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """Dispatchers made in the test take this path, the fast path or the reference
    path alone (read when each is made), each path with dispatchers apart (a
    function's are found in its `__dict__`)."""
    from filterjit import _fastpath, _owners, clear_caches

    if request.param == "fast" and not _fastpath.ENABLED:
        pytest.skip("the fast path is off (FILTERJIT_FASTPATH=0)")
    monkeypatch.setattr(_fastpath, "ENABLED", request.param == "fast")
    monkeypatch.setattr(_owners, "_ATTRIBUTE", f"__filterjit_{request.param}__")
    monkeypatch.setattr(_owners, "_without_dict", {})
    clear_caches()
    yield request.param
    clear_caches()


# Imported by a test module, it runs each of the module's tests on both paths.
each_path = pytest.fixture(params=["fast", "reference"], autouse=True, name="path")(
    _each_path
)

# Imported by a test module, it runs on both paths each test that asks for `path`
# or is marked `on_each_path`; the module's other tests, as they are.
both_paths = pytest.fixture(params=["fast", "reference"], name="path")(_each_path)
on_each_path = pytest.mark.usefixtures("path")


class ValueBox:
    """A mutable value compared (and hashed) by value, whose identity a program can
    see: which of two equal ones comes back matters."""

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ValueBox) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)


def evict_with_bound(wrapper: Any, bound: int = 1) -> None:
    """Lowers the bound on entries of `wrapper`'s caches (every level) to `bound`,
    so that the next new entries evict the oldest: what a cache holds, it holds
    until evicted by that bound."""
    dispatcher = wrapper._dispatcher
    for cache in (*dispatcher.entries, *dispatcher.routes, dispatcher._programs):
        cache.maxsize = bound


def evict_everything() -> None:
    """Evicts every entry of every live dispatcher's caches, and every dispatcher
    an owner holds, as their bounds on entries would once filled: each bound
    lowered to zero for one insertion, then restored."""
    import gc

    from filterjit import _dispatch, _fastpath, _owners

    caches = [
        cache
        for dispatcher in list(_dispatch._dispatchers)
        for cache in (*dispatcher.entries, *dispatcher.routes, dispatcher._programs)
    ]
    caches += [o.dispatchers for o in gc.get_objects() if type(o) is _owners._Holder]
    for cache in caches:
        bound, cache.maxsize = cache.maxsize, 0
        cache.put(object(), None)  # pyright: ignore[reportArgumentType]
        cache.maxsize = bound
    for dispatcher in list(_dispatch._dispatchers):
        # The hits of a level's latest routes, which its next calls replace.
        dispatcher.hits[:] = [_fastpath.miss] * len(dispatcher.hits)
        for latest in dispatcher._latest:
            latest.clear()


class Knob:
    """A value type compared and hashed by its `k`, which changes in place."""

    def __init__(self, k: int):
        self.k = k

    def __eq__(self, other: object) -> bool:
        return type(other) is Knob and other.k == self.k

    def __hash__(self) -> int:
        return hash(self.k)

    def __repr__(self) -> str:
        return f"Knob({self.k})"


def run_peers(
    tmp_path: Path, file: str, source: str, flags: list[str]
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Runs `benchmarks/peers.py` with `flags` over a suite of one test file,
    `tests/file` holding `source`, with this checkout's filterjit: its process,
    and the suite's runs as `--json` writes them."""
    suite = tmp_path / "suite"
    (suite / "tests").mkdir(parents=True)
    (suite / "tests" / file).write_text(source)
    out = tmp_path / "outcomes.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peers.py"), *flags]
        + ["--json", str(out), str(suite), "--", f"tests/{file}", "-p", "no:randomly"],
        capture_output=True,
        text=True,
        timeout=600,
        env=subprocess_env(),  # this checkout's filterjit, not an installed one
    )
    runs = json.loads(out.read_text())["suite"] if out.exists() else {}
    return result, runs
