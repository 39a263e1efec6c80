"""The wrapper object: decorator forms, metadata, repr, thread safety."""

import threading

import jax
import jax.numpy as jnp
import numpy as np

from filterjit import filter_jit


def scale(x, n: int = 2):
    """Multiplies by n."""
    return x * n


def test_decorator_forms_return_a_wrapper_instance():
    plain = filter_jit(scale)
    configured = filter_jit(inline=True)(scale)
    for wrapped in (plain, configured):
        assert not hasattr(wrapped, "__code__")  # a class instance, not a closure
        assert wrapped(jnp.float32(3)) == 6.0
    assert type(plain) is type(configured)


def test_metadata():
    wrapped = filter_jit(scale)
    assert wrapped.__wrapped__ is scale
    assert wrapped.__name__ == "scale"
    assert wrapped.__qualname__ == "scale"
    assert wrapped.__doc__ == "Multiplies by n."
    assert wrapped.__module__ == scale.__module__
    assert wrapped.__annotations__ == {"n": int}
    assert "scale" in repr(wrapped) and "filter_jit" in repr(wrapped)


def test_thread_safety_with_different_statics():
    f = filter_jit(lambda x, n, s: (x * n, s * int(n)))
    x = jnp.arange(3.0)
    errors = []

    def work(i: int):
        try:
            for j in range(20):
                n = (i + j) % 5
                y, s = f(x, n, "ab")
                np.testing.assert_allclose(y, np.arange(3.0) * n)
                assert s == "ab" * n
                z = jax.jit(lambda x: f(x, np.float32(n), "c")[0])(x)
                np.testing.assert_allclose(z, np.arange(3.0) * n)
        except Exception as e:  # collected and re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
