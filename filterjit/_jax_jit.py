"""`filterjit.jit`: `jax.jit` itself outside staged traces; inside one, the nested
no-op of `filter_jit`."""

import functools as ft
from collections.abc import Callable
from typing import Any, overload, ParamSpec, TypeVar

import jax

from . import _trace
from ._jit import FilterJitWrapper
from ._options import make_options


_P = ParamSpec("_P")
_R = TypeVar("_R")

# The jax.jit keywords that mean the same to a nested `filter_jit` call, which
# passes them on to the jax.jit of its nested program. The others do not apply to
# a nested no-op: every leaf that is not a tracer is static there already
# (`static_argnums`, `static_argnames`); a nested call donates nothing, as jax.jit
# nested does not (`donate_argnums`, `donate_argnames`); and shardings are left
# to the outer program (`in_shardings`, `out_shardings`).
_NESTED_KEYWORDS = ("keep_unused", "inline", "compiler_options", "device", "backend")

_NOT_GIVEN: Any = object()


@ft.cache
def _method_names(kind: type) -> tuple[str, ...]:
    # What `dir` lists of a jitted object beyond its `__dict__`: `lower`, `trace`,
    # `_cache_size`, ... Read once per type: `dir` costs 10 µs, and libraries make
    # wrappers on the fly.
    return tuple(name for name in dir(kind) if not name.startswith("__"))


@overload
def jit(fun: Callable[_P, _R], /, **jit_kwargs: Any) -> Callable[_P, _R]: ...


@overload
def jit(**jit_kwargs: Any) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]: ...


def jit(fun: Any = _NOT_GIVEN, /, **jit_kwargs: Any) -> Any:
    """`jax.jit`, whose nested calls are semantic no-ops.

    Takes exactly `jax.jit`'s arguments (`static_argnums`, `static_argnames`,
    `donate_argnums`, `donate_argnames`, `in_shardings`, `out_shardings`,
    `keep_unused`, `inline`, `compiler_options`, ...). At the top level and under
    eager transforms (`jax.grad`, `jax.vmap`, ... not inside a `jax.jit`), a call
    is a call of `jax.jit(fun, **jit_kwargs)`: the same tracing, caching, errors,
    donation and shardings, with only a check of the trace level in front of
    JAX's dispatch. `.lower`, `.trace`, `.eval_shape` and `.clear_cache` are
    `jax.jit`'s.

    Inside a staged trace (an outer `jax.jit`, a `lax.scan` body,
    `jax.checkpoint`, ...), a call is `filterjit.filter_jit`'s nested call: only
    the leaves that are tracers already are traced; Python values, NumPy values
    and concrete JAX arrays reach `fun` unchanged, static or not, so that the
    decorator changes nothing the program computes. Donation and shardings do
    not apply there; `keep_unused`, `inline` and `compiler_options` do.

    **Arguments:**

    - `fun`: the function to compile. Omit it to use `jit(**jit_kwargs)` as a
        decorator.
    - `jit_kwargs`: `jax.jit`'s keyword arguments, checked by `jax.jit`.

    **Returns:**

    A function with the signature of `fun`, usable as a method.

    !!! example

        ```python
        @filterjit.jit
        def power(x, n):
            return jax.lax.fori_loop(0, n, lambda _, y: y * x, jnp.ones_like(x))

        power(2.0, 3)  # 8.0: jax.jit(power)(2.0, 3), n traced
        # Nested, n stays the Python int 3: the loop can be differentiated.
        jax.jit(jax.grad(lambda x: power(x, 3)))(2.0)  # 12.0
        ```
    """
    if fun is _NOT_GIVEN:  # as jax.jit(**jit_kwargs): a decorator
        return ft.partial(jit, **jit_kwargs)
    jitted: Any = jax.jit(fun, **jit_kwargs)  # JAX checks the arguments, as it would
    nested_options = make_options(
        **{name: jit_kwargs[name] for name in _NESTED_KEYWORDS if name in jit_kwargs}
    )
    nested: FilterJitWrapper[..., Any] | None = None

    def staged(*args: Any, **kwargs: Any) -> Any:
        nonlocal nested
        if nested is None:  # made on first use: most wrappers never nest
            nested = FilterJitWrapper(fun, nested_options)
        return nested(*args, **kwargs)

    def clear_cache() -> None:
        jitted.clear_cache()
        if nested is not None:
            nested._dispatcher.clear()

    wrapper: Any = _trace.by_level(jitted, staged)
    # What jax.jit's object holds: the function's metadata and `__dict__` (as
    # functools.wraps copies them), `__wrapped__`, and its methods.
    for name, value in vars(jitted).items():
        setattr(wrapper, name, value)
    for name in _method_names(type(jitted)):
        setattr(wrapper, name, getattr(jitted, name))
    wrapper.__getstate__ = jitted.__getstate__
    wrapper.clear_cache = clear_cache
    return wrapper
