"""Resident memory growth when every outer trace hands a fresh NumPy array to a
nested call: does a cache keep those arrays alive?

Each implementation runs in a subprocess of its own (`run.py --memory-child
NAME`), so that no implementation's leftovers count against another.
"""

import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _harness import (
    EQX,
    FILTERJIT,
    fmt_number,
    JAX,
    markdown_table,
    NA,
    Section,
    Settings,
    Target,
    UNDECORATED,
)

import filterjit


LIMIT_MIB = 60.0  # filterjit growth over the full run
ARRAY_BYTES = 2**20
WARMUP = 10
UNBOUNDED = "unbounded cache"
NAMES = (UNDECORATED, JAX, EQX, FILTERJIT, UNBOUNDED)
_MIB = 2**20


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
    if name == UNDECORATED:
        return inner
    if name == JAX:
        return jax.jit(inner)
    if name == EQX:
        return eqx.filter_jit(inner)
    if name == FILTERJIT:
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


def run(settings: Settings) -> Section:
    iterations = settings.pick(full=300, quick=20)
    if not os.path.exists("/proc/self/statm"):
        header = f"{NA}: resident memory is read from /proc/self/statm (Linux)."
        return Section("memory", header, "")
    growth = {name: _run_child(name, iterations)["growth"] / _MIB for name in NAMES}
    headers = ["outer traces", *(f"{name} (MiB)" for name in NAMES)]
    row = [str(iterations), *(fmt_number(growth[name]) for name in NAMES)]
    targets = []
    if settings.targets:
        target = Target("memory", "growth", growth[FILTERJIT], LIMIT_MIB, " MiB")
        targets.append(target)
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
    return Section("memory", header, markdown_table(headers, [row]), targets)
