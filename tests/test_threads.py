"""Threads, and the miss path: no lock is held while the function is traced,
compiled or run, so a function may call itself from another thread (a host
callback); concurrent first calls stay correct; a first trace runs once.

Every wait has a timeout, and the scenarios that could hang run in a subprocess
with one, so a deadlock fails the test instead of stopping the suite."""

import concurrent.futures as cf
import subprocess
import sys
import textwrap
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import subprocess_env, TraceCounter

from filterjit import filter_jit


_TIMEOUT = 120


def _run_script(source: str) -> str:
    """Runs `source` in a fresh interpreter with this checkout's filterjit; its
    stdout. A hang fails after `_TIMEOUT` seconds."""
    env = subprocess_env()
    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(source)],
            capture_output=True,
            text=True,
            timeout=_TIMEOUT,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the script did not finish in {_TIMEOUT} s (a deadlock)")
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_host_callback_that_calls_the_function_from_another_thread_completes():
    out = _run_script(
        """
        import concurrent.futures as cf
        import jax, jax.numpy as jnp, numpy as np
        from filterjit import filter_jit

        pool = cf.ThreadPoolExecutor(4)

        def g(x, depth):
            if depth == 0:
                return x + 1
            def host(v):
                return np.asarray(pool.submit(jitted, v, depth - 1).result())
            shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
            return jax.pure_callback(host, shape, x) * 2

        for name, jitted in [
            ("jax.jit", jax.jit(g, static_argnums=1)),
            ("filter_jit", filter_jit(g)),
        ]:
            print(name, jitted(jnp.ones(3), 3).tolist())
        """
    )
    assert out.splitlines() == [
        "jax.jit [16.0, 16.0, 16.0]",
        "filter_jit [16.0, 16.0, 16.0]",
    ]


def test_runtime_checks_in_first_calls_from_many_threads_complete():
    out = _run_script(
        """
        import concurrent.futures as cf
        import equinox as eqx, jax.numpy as jnp
        from filterjit import filter_jit

        @filter_jit
        def checked(x):
            return eqx.error_if(x, x < 0, "negative") + 1

        def call(n):
            x = jnp.arange(float(n + 1)) - (n % 2)  # odd n: a negative entry
            try:
                return checked(x).sum().item()
            except eqx.EquinoxRuntimeError as e:
                return "negative" in str(e)

        with cf.ThreadPoolExecutor(8) as pool:
            for _ in range(3):
                print(list(pool.map(call, range(8))))
        """
    )
    expected = [True if n % 2 else float(sum(range(n + 1)) + n + 1) for n in range(8)]
    assert out.splitlines() == [str(expected)] * 3


def _shapes(thread: int) -> list[tuple[int, ...]]:
    # Shapes of their own, and shapes every thread calls.
    return [(thread + 1,), (thread + 1, 2), (5,), (2, 3)]


def test_eight_threads_calling_one_function_with_new_shapes():
    traces = []

    def f(x, n):
        traces.append(x.shape)
        return jnp.sin(x) * n

    wrapped = filter_jit(f)
    reference = jax.jit(f, static_argnums=1)
    barrier = threading.Barrier(8)

    def work(thread):
        barrier.wait(timeout=_TIMEOUT)
        out = []
        for shape in _shapes(thread):
            x = jnp.ones(shape) * thread
            out.append((wrapped(x, 3), reference(x, 3)))
            # Nested too: a nested first call of the same function.
            out.append((jax.jit(lambda x: wrapped(x, 2))(x), jnp.sin(x) * 2))
        return out

    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(work, thread) for thread in range(8)]
        results = [future.result(timeout=_TIMEOUT) for future in futures]
    for pairs in results:
        for got, want in pairs:
            np.testing.assert_allclose(got, want, rtol=1e-6)
    # Each shape seen traced, and every later call a hit.
    shapes = {s for thread in range(8) for s in _shapes(thread)}
    assert set(traces) == shapes
    count = len(traces)
    for thread in range(8):
        for shape in _shapes(thread):
            wrapped(jnp.ones(shape), 3)
    assert len(traces) == count


def test_concurrent_first_calls_of_one_key_share_one_entry():
    traces = []

    @filter_jit
    def f(x, k):
        traces.append(k)
        return x * k

    barrier = threading.Barrier(8)

    def work(_):
        barrier.wait(timeout=_TIMEOUT)
        return f(jnp.arange(4.0), 3).tolist()

    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(work, i) for i in range(8)]
        results = [future.result(timeout=_TIMEOUT) for future in futures]
    assert results == [[0.0, 3.0, 6.0, 9.0]] * 8
    assert len(f._dispatcher.entries[0]) == 1
    # One entry, traced once (as `test_concurrent_first_calls_trace_once`), and
    # none after.
    assert len(traces) == 1
    count = len(traces)
    f(jnp.arange(4.0), 3)
    assert len(traces) == count


class _FirstTraceFails:
    """A function that raises on its first trace only."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("only the first trace fails")
        return x + 1


def test_an_error_in_a_first_trace_is_raised_once_at_the_top_level():
    fun = _FirstTraceFails()
    wrapped = filter_jit(lambda x: fun(x))
    with pytest.raises(RuntimeError, match="only the first trace fails"):
        wrapped(jnp.ones(2))
    assert fun.calls == 1
    # As jax.jit: the next call traces anew.
    assert wrapped(jnp.ones(2)).tolist() == [2.0, 2.0]
    reference = _FirstTraceFails()
    with pytest.raises(RuntimeError, match="only the first trace fails"):
        jax.jit(lambda x: reference(x))(jnp.ones(2))


def test_an_error_in_a_first_trace_is_raised_once_nested():
    for decorated in (True, False):
        fun = _FirstTraceFails()
        inner = filter_jit(lambda x: fun(x)) if decorated else fun
        with pytest.raises(RuntimeError, match="only the first trace fails"):
            jax.jit(lambda x: inner(x) * 2)(jnp.ones(2))
        assert fun.calls == 1
        assert jax.jit(lambda x: inner(x) * 2)(jnp.ones(2)).tolist() == [4.0, 4.0]


def test_an_error_in_a_first_trace_with_a_static_is_raised_once():
    fun = _FirstTraceFails()
    wrapped = filter_jit(lambda x, n: fun(x) * n)
    with pytest.raises(RuntimeError, match="only the first trace fails"):
        wrapped(jnp.ones(2), 2)
    assert fun.calls == 1
    assert eqx.filter_jit(lambda x: x)(1) == 1  # Equinox keeps working beside it


# Guards: eight first calls at once trace the function once.
def test_concurrent_first_calls_trace_once():
    counter = TraceCounter(lambda x: x + 1)
    f = filter_jit(counter)
    start = threading.Barrier(8)
    errors = []

    def call():
        try:
            start.wait()
            f(jnp.ones(3))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert counter.count == 1
