"""What caches keep alive.

- Resident memory growth when every outer trace hands a fresh NumPy array to a
  nested call: does a cache keep those arrays alive? Each implementation runs in a
  subprocess of its own (`run.py --memory-child NAME`), so that no
  implementation's leftovers count against another.
- Ownership: classes with a decorated method, defined in a loop, whose instances
  are not pytrees (so `self` is a static leaf), called and dropped: are they freed?
  And wrappers of fresh lambdas, dropped: is their generated code freed? One
  subprocess (`run.py --ownership-child`) measures every implementation in turn,
  each against its own baseline.
"""

import functools as ft
import gc
import json
import linecache
import os
import subprocess
import sys
import tracemalloc
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness as harness
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import filterjit


LIMIT_MIB = 60.0  # filterjit growth over the full run
ARRAY_BYTES = 2**20
WARMUP = 10
UNBOUNDED = "unbounded cache"
NAMES = (harness.UNDECORATED, harness.JAX, harness.EQX, harness.FILTERJIT, UNBOUNDED)
_MIB = 2**20

# Ownership: classes defined in a loop, each instance holding a blob of this many
# bytes; wrappers of fresh lambdas.
BLOB_BYTES = 200_000
OWNERS = (harness.JAX, harness.EQX, harness.FILTERJIT)


def inner(x: jax.Array, c: np.ndarray) -> jax.Array:
    return x + jnp.mean(c)


def _unbounded_cache() -> Callable[[jax.Array, np.ndarray], jax.Array]:
    """A reference for what the measurement catches: a nested wrapper that keys on
    the constant's value and keeps every entry."""
    cache: dict[bytes, Callable[[jax.Array], jax.Array]] = {}

    def helper(x: jax.Array, c: np.ndarray) -> jax.Array:
        key = c.tobytes()
        if key not in cache:
            cache[key] = jax.jit(lambda y: inner(y, c))
        return cache[key](x)

    return helper


def _helper(name: str) -> Callable[[jax.Array, np.ndarray], jax.Array]:
    if name == harness.UNDECORATED:
        return inner
    if name == harness.JAX:
        return jax.jit(inner)
    if name == harness.EQX:
        return eqx.filter_jit(inner)
    if name == harness.FILTERJIT:
        return filterjit.filter_jit(inner)
    if name == UNBOUNDED:
        return _unbounded_cache()
    raise ValueError(f"unknown implementation {name!r}; expected one of {NAMES}")


def resident_bytes() -> int:
    """Resident set size of this process, from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def child(name: str, iterations: int) -> dict[str, Any]:
    """Runs in the subprocess: `iterations` outer traces, each closing over a fresh
    NumPy array of `ARRAY_BYTES` bytes that it passes to the nested helper."""
    helper = _helper(name)
    x = jnp.ones((4,), dtype=jnp.float32)
    rng = np.random.default_rng(0)

    def trace(fun: Callable[[jax.Array, np.ndarray], jax.Array], c: np.ndarray) -> None:
        jax.make_jaxpr(lambda y: fun(y, c))(x)

    # Warm up JAX's own machinery and the allocator on arrays of the measured size
    # without the helper, and the helper on small arrays, which pin next to
    # nothing.
    for _ in range(WARMUP):
        trace(inner, rng.standard_normal(ARRAY_BYTES // 4).astype(np.float32))
        trace(helper, rng.standard_normal(4).astype(np.float32))
    gc.collect()
    before = resident_bytes()
    for _ in range(iterations):
        trace(helper, rng.standard_normal(ARRAY_BYTES // 4).astype(np.float32))
    gc.collect()
    after = resident_bytes()
    return {"name": name, "iterations": iterations, "growth": after - before}


def _run_child(name: str, iterations: int) -> dict[str, Any]:
    script = Path(__file__).with_name("run.py")
    command = [sys.executable, str(script), "--memory-child", name]
    command += ["--iterations", str(iterations)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"The memory child for {name} failed (exit {done.returncode}):\n"
            f"{done.stderr}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _method_decorator(name: str) -> Callable[[Any], Any]:
    """How each implementation decorates a method whose `self` is static."""
    if name == harness.JAX:
        return ft.partial(jax.jit, static_argnums=0)
    if name == harness.EQX:
        return eqx.filter_jit
    if name == harness.FILTERJIT:
        return filterjit.filter_jit
    raise ValueError(f"unknown implementation {name!r}; expected one of {OWNERS}")


def _make_class(index: int, decorate: Callable[[Any], Any]) -> type:
    """A class with a decorated method, whose instances are not pytrees."""

    class Holder:
        def __init__(self) -> None:
            self.blob = np.ones(BLOB_BYTES // 8)

        @decorate
        def method(self, x: jax.Array) -> jax.Array:
            return x + self.blob.shape[0]

    Holder.__name__ = Holder.__qualname__ = f"Holder{index}"
    return Holder


def _use_classes(
    count: int, decorate: Callable[[Any], Any], refs: list[tuple[Any, Any, Any]]
) -> None:
    """Defines `count` classes, calls each one's method on an instance at the top
    level and nested, and drops them, keeping weak references in `refs`."""
    x = jnp.ones(4)
    for index in range(count):
        cls = _make_class(index, decorate)
        instance = cls()
        jax.block_until_ready(instance.method(x))
        jax.make_jaxpr(lambda y: instance.method(y))(x)
        refs.append(
            (weakref.ref(cls), weakref.ref(instance), weakref.ref(instance.blob))
        )


def _fresh_wrapper(name: str) -> Callable[..., Any]:
    """A wrapper of a fresh lambda, with a default and a static argument."""
    if name == harness.JAX:
        return jax.jit(lambda x, n, k=1: x * n + k, static_argnums=1)
    if name == harness.EQX:
        return eqx.filter_jit(lambda x, n, k=1: x * n + k)
    return filterjit.filter_jit(lambda x, n, k=1: x * n + k)


def _use_lambdas(count: int, name: str) -> None:
    x = jnp.ones(4)
    for _ in range(count):
        wrapper = _fresh_wrapper(name)
        jax.block_until_ready(wrapper(x, 2))
        jax.make_jaxpr(lambda y: wrapper(y, 2))(x)


def _jit_of(name: str) -> Callable[[Any], Any]:
    """How each implementation decorates a callable with no static arguments."""
    if name == harness.JAX:
        return jax.jit
    if name == harness.EQX:
        return eqx.filter_jit
    return filterjit.filter_jit


def _use_callables(
    count: int, name: str
) -> tuple[list[Any], list[Any], list[Any] | None, Any]:
    """Callables without a `__dict__` of their own, and statics compared by
    identity that the function returns, each called at the top level and nested,
    then dropped: weak references to each slotted callable, each class used as
    the function, and each returned static (`None` where the implementation
    cannot return one: jax.jit); and the wrapper that returned them, which the
    caller keeps alive while it counts (a cache freed with its wrapper frees
    everything, and proves nothing)."""
    jit = _jit_of(name)
    x = jnp.ones(4)
    slotted, classes = [], []
    for _ in range(count):

        class Slotted:
            __slots__ = ("blob", "__weakref__")

            def __init__(self) -> None:
                self.blob = np.ones(BLOB_BYTES // 8)

            def __call__(self, x: jax.Array) -> jax.Array:
                return x + self.blob.shape[0]

        class AsFunction:
            def __new__(cls, x: jax.Array) -> Any:
                return x + 1

        instance = Slotted()
        for fun in (instance, AsFunction):
            wrapper = jit(fun)
            jax.block_until_ready(wrapper(x))
            jax.make_jaxpr(lambda y, wrapper=wrapper: wrapper(y))(x)
        slotted.append(weakref.ref(instance))
        classes.append(weakref.ref(AsFunction))
        del instance, fun, wrapper
    if name == harness.JAX:
        return slotted, classes, None, None
    tags = []
    returns_tag = jit(lambda x, tag: (x + 1, tag))
    for _ in range(count):
        tag = _Tag()
        tags.append(weakref.ref(tag))
        jax.block_until_ready(returns_tag(x, tag)[0])
        jax.make_jaxpr(lambda y, tag=tag: returns_tag(y, tag)[0])(x)
        del tag
    return slotted, classes, tags, returns_tag


def _alive(refs: list[Any] | None) -> int | None:
    return None if refs is None else sum(ref() is not None for ref in refs)


class _Tag:
    """A static compared by identity."""


def _collect() -> None:
    filterjit.clear_caches()
    jax.clear_caches()
    gc.collect()


def ownership_child(classes: int, lambdas: int, warmup: int) -> dict[str, Any]:
    """Runs in the subprocess: for each implementation, after a warm-up round, the
    classes (what stays alive after `gc.collect()`, and how much the Python heap
    grew, by `tracemalloc`), then the lambdas (entries added to `linecache` that
    remain after every cache is cleared and garbage collected)."""
    results: dict[str, Any] = {}
    for name in OWNERS:
        decorate = _method_decorator(name)
        _use_classes(warmup, decorate, [])  # warm-up: JAX's and the allocator's
        _use_lambdas(warmup, name)
        _use_callables(warmup, name)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        refs: list[tuple[Any, Any, Any]] = []
        _use_classes(classes, decorate, refs)
        gc.collect()
        growth = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        alive_classes = sum(cls() is not None for cls, _, _ in refs)
        alive_instances = sum(instance() is not None for _, instance, _ in refs)
        held = sum(blob().nbytes for _, _, blob in refs if blob() is not None)
        _collect()
        alive_after_clearing = sum(cls() is not None for cls, _, _ in refs)

        slotted, classes_as_functions, tags, returns_tag = _use_callables(classes, name)
        gc.collect()
        callables_alive = [_alive(slotted), _alive(classes_as_functions), _alive(tags)]
        del returns_tag

        _collect()
        tags_after_clearing = _alive(tags)
        entries = set(linecache.cache)
        _use_lambdas(lambdas, name)
        _collect()
        left = len(set(linecache.cache) - entries)
        results[name] = {
            "classes": alive_classes,
            "instances": alive_instances,
            "held": held,
            "growth": growth,
            "freed_by_clearing": alive_classes - alive_after_clearing,
            "linecache": left,
            "slotted": callables_alive[0],
            "as_function": callables_alive[1],
            "tags": callables_alive[2],
            "tags_cleared": tags_after_clearing,
        }
    return results


def _run_ownership_child(classes: int, lambdas: int, warmup: int) -> dict[str, Any]:
    script = Path(__file__).with_name("run.py")
    command = [sys.executable, str(script), "--ownership-child"]
    command += ["--classes", str(classes), "--lambdas", str(lambdas)]
    command += ["--warmup", str(warmup)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"The ownership child failed (exit {done.returncode}):\n{done.stderr}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _count(value: int | None) -> str:
    return harness.NA if value is None else str(value)


def _ownership(settings: harness.Settings) -> tuple[str, list[harness.Target]]:
    classes = settings.pick(full=30, quick=3)
    lambdas = settings.pick(full=100, quick=5)
    warmup = settings.pick(full=3, quick=1)
    results = _run_ownership_child(classes, lambdas, warmup)
    measures = [
        (f"classes alive, of {classes}", "classes", str),
        (f"instances alive, of {classes}", "instances", str),
        ("instance bytes held (blobs alive)", "held", str),
        (
            "Python heap growth, kB (tracemalloc)",
            "growth",
            lambda v: harness.fmt_number(v / 1e3),
        ),
        ("of the classes alive, freed by clearing caches", "freed_by_clearing", str),
        (f"linecache entries left, of {lambdas} wrappers", "linecache", str),
        (f"slotted callables alive, of {classes}", "slotted", _count),
        (f"classes used as the function alive, of {classes}", "as_function", _count),
        (f"identity statics returned alive, of {classes}", "tags", _count),
        ("of those, alive after clearing caches", "tags_cleared", _count),
    ]
    # Targets: zero for filterjit. A static keyed by identity is held until
    # evicted, as jax.jit and Equinox hold theirs: freed with the caches.
    zero = {
        "held": ("instance bytes held", " B"),
        "linecache": ("linecache entries left", ""),
        "slotted": ("slotted callables alive", ""),
        "as_function": ("classes used as the function alive", ""),
        "tags_cleared": ("identity statics alive after clearing caches", ""),
    }
    headers = ["after `gc.collect()`", *OWNERS]
    targets = []
    rows = []
    for label, key, fmt in measures:
        row = [label, *(fmt(results[name][key]) for name in OWNERS)]
        if settings.targets:
            if key in zero:
                measure, unit = zero[key]
                target = harness.Target(
                    "memory", measure, results[harness.FILTERJIT][key], 0, unit
                )
                targets.append(target)
                row += [target.describe(), target.verdict]
            else:
                row += ["", ""]
        rows.append(row)
    if settings.targets:
        headers += ["target (filterjit)", "result"]
    text = (
        f"Ownership, in one subprocess, each implementation after a warm-up round "
        f"of its own: {classes} classes defined in a loop, each with a decorated "
        f"method `method(self, x)` (jax.jit: `static_argnums=0`) whose instances "
        f"are not pytrees (so `self` is a static leaf) and hold a "
        f"{BLOB_BYTES // 1000} kB NumPy blob; one instance of each is called at the "
        "top level and nested (`jax.make_jaxpr`), then class and instance are "
        "dropped. Alive: by weak references after `gc.collect()`; heap growth: "
        "`tracemalloc` over that loop, which includes what JAX itself keeps. "
        "Then `filterjit.clear_caches()` and `jax.clear_caches()`: how many of those "
        f"alive that frees. Last, {lambdas} wrappers of fresh lambdas "
        "(`lambda x, n, k=1: x * n + k`, `n` static), each called at the top level "
        "and nested, then dropped: entries added to `linecache` that remain after "
        "both caches are cleared and garbage collected. Then, as many times as "
        "there are classes: a callable instance with `__slots__` (and a "
        "`__weakref__` slot, which jax.jit needs) and a class used as the function "
        "(its `__new__` returns an array), each decorated, called at the top level "
        "and nested, and dropped; and a fresh static compared by identity passed "
        "to `lambda x, tag: (x + 1, tag)`, which returns it (jax.jit cannot return "
        "it: n/a), the wrapper kept alive. Alive: by weak references after "
        "`gc.collect()`, before any cache is cleared, and after both are cleared "
        "(the wrapper dropped)."
    )
    return text + "\n\n" + harness.markdown_table(headers, rows), targets


def run(settings: harness.Settings) -> harness.Section:
    ownership, targets = _ownership(settings)
    iterations = settings.pick(full=300, quick=20)
    if not os.path.exists("/proc/self/statm"):
        header = f"{harness.NA}: resident memory is read from /proc/self/statm (Linux)."
        return harness.Section("memory", header, "", targets, [ownership])
    growth = {name: _run_child(name, iterations)["growth"] / _MIB for name in NAMES}
    headers = ["outer traces", *(f"{name} (MiB)" for name in NAMES)]
    row = [str(iterations), *(harness.fmt_number(growth[name]) for name in NAMES)]
    if settings.targets:
        target = harness.Target(
            "memory", "growth", growth[harness.FILTERJIT], LIMIT_MIB, " MiB"
        )
        targets.insert(0, target)
        headers += ["target", "result"]
        row += [target.describe(), target.verdict]
    header = (
        f"Growth of resident memory (RSS, /proc/self/statm, after `gc.collect()`) "
        f"over {iterations} outer traces (`jax.make_jaxpr`), each closing over a "
        f"fresh 1 MiB NumPy float32 array and passing it to a nested call of "
        "`x + jnp.mean(c)`. Each column runs in a subprocess of its own, after "
        f"{WARMUP} warm-up traces of the undecorated function with 1 MiB arrays "
        "and of the implementation with small ones. jax.jit and eqx.filter_jit "
        "trace the array, so nothing pins it; filterjit keeps it concrete and "
        "caches the nested trace by its value, in a cache bounded in bytes. "
        f"'{UNBOUNDED}' is a reference wrapper that keys on the value and keeps "
        "every entry."
    )
    table = harness.markdown_table(headers, [row])
    return harness.Section("memory", header, table, targets, [ownership])
