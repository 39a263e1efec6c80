"""Looking at what filter_jit does: explain a call, count traces, clear caches."""

import sys
import warnings
from typing import Any

import jax

from ._diagnostics import Explanation
from ._dispatch import clear_all
from ._donated import user_frame
from ._function import is_partial, name_of, opened
from ._jax_jit import JitWrapper
from ._jit import _decorate, FilterJitWrapper
from ._nested import jit_cache_size
from ._options import Options
from ._tracebacks import hiding_frames


@hiding_frames
def explain(fun: Any, /, *args: Any, **kwargs: Any) -> Explanation:  # checked below
    """Explains what calling `fun(*args, **kwargs)` here would do, without calling it.

    **Arguments:**

    - `fun`: a `filter_jit`-wrapped function (a method read from an instance,
        `model.__call__`, or through its class, `Model.__call__` with the instance
        first), a `filterjit.jit` one (with `jax.jit`'s roles where it is
        `jax.jit`), or a plain function (as if decorated with `filter_jit`). A
        `jax.jit` function or another library's jit wrapper is explained as
        `filter_jit` wrapped around it, with a warning.
    - `*args`, `**kwargs`: the arguments of the call to explain.

    **Returns:**

    An `Explanation`, whose `str()` is a table with one row per leaf of the
    arguments (a method's fields as it names them, `self.weight`, and parameters
    left to their defaults too): its path (`params['w']`), its role (`traced`,
    `static`, or `concrete`: an array passed through unchanged inside a staged
    trace), and its abstract or shortened value; and whether the call would hit the
    cache (attributes `rows`, `level` and `cache_hit`). The roles are those a call
    at this point would get (inside `jax.jit`, nested). A call that would trace is
    compared with the nearest cached trace (the one that differs in the fewest
    leaves): the table marks the rows that differ, with that trace's values, and
    says why each traces (`misses` lists their paths).

    **Raises:**

    - `TypeError`: `fun` is wrapped by `equinox.filter_jit` (explain the function
        itself, or call `filterjit.patch_equinox()` first), or the arguments do not
        fit its signature.

    !!! example

        ```python
        @filter_jit
        def f(params, n):
            ...

        print(filterjit.explain(f, {"w": jnp.ones(3)}, 2))
        # filter_jit(f), called at the top level: would trace
        # argument     role    value
        # -----------  ------  ------
        # params['w']  traced  f32[3]
        # n            static  2
        ```
    """
    fun, args = _unbind(fun, args)
    if isinstance(fun, _WRAPPERS):
        return fun._explain(args, kwargs)
    _check_not_another_jit(fun)
    wrapper: FilterJitWrapper[..., Any] = _decorate(Options(), fun, caller="explain")
    explanation = wrapper._explain(args, kwargs)
    if type(fun) is _JAX_JIT_TYPE:  # explained as `filter_jit(jax.jit(f))`
        explanation.name = f"jax.jit({explanation.name})"
    return explanation


_JAX_JIT_TYPE = type(jax.jit(lambda: None))


def _equinox_jit(fun: Any) -> Any:
    """The `equinox.filter_jit` wrapper that `fun` is (or a method of), or `None`."""
    fun = getattr(fun, "func", fun)  # a method read from an instance: a Partial
    kind = type(fun)
    equinox = kind.__module__.startswith("equinox.")
    return fun if equinox and kind.__qualname__ == "_JitWrapper" else None


def _check_not_another_jit(fun: Any) -> None:
    """Raises for Equinox's `filter_jit` wrapper, and warns for another library's
    jit (`jax.jit`'s included): `explain` says what filterjit's wrapper would do."""
    if (wrapper := _equinox_jit(fun)) is not None:
        wrapped = getattr(wrapper, "fn", None)  # Equinox keeps the name here
        if not isinstance(wrapped, str):
            wrapped = name_of(getattr(wrapper, "__wrapped__", wrapper))
        raise TypeError(
            f"explain: `{wrapped}` is wrapped by `equinox.filter_jit`, not by "
            "filterjit, and explain can only say what filterjit's wrapper would do "
            "(Equinox's keys and caches its calls differently: it traces NumPy "
            "scalars, say, where filterjit keeps them unchanged inside traces). "
            "`filterjit.patch_equinox()` makes `eqx.filter_jit` filterjit's from "
            "then on, and replaces the Equinox wrappers already made that are "
            "attributes of a module or a class (a function decorated at a module's "
            "top level, a method); one held elsewhere (a local variable, a list) "
            "stays Equinox's. Call it, then explain the wrapper read again from its "
            "module or class, or explain the function itself: "
            f"`explain({wrapped.rpartition('.')[2]}, ...)` explains it as "
            "`filter_jit` would run it."
        )
    if type(fun) is _JAX_JIT_TYPE:
        other = f"`jax.jit({name_of(fun)})`, a jax.jit function"
    elif callable(getattr(fun, "lower", None)):
        kind = f"{type(fun).__module__}.{type(fun).__name__}"
        other = f"`{name_of(fun)}`, a jit wrapper of type `{kind}`"
    else:
        return
    warnings.warn(
        f"explain: {other}, is not filterjit's: the table shows what "
        f"`filter_jit` wrapped around it would do, which is not what calling it "
        "does (jax.jit traces every argument not in `static_argnums`, and its cache "
        "is its own). Use `filterjit.jit` or `filterjit.filter_jit` in its place to "
        "explain what a call does.",
        UserWarning,
        stacklevel=user_frame(sys._getframe())[1],
    )


_WRAPPERS = (FilterJitWrapper, JitWrapper)


def _unbind(fun: Any, args: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    # A decorated method read from an instance: the wrapper, the instance first.
    pieces = opened(fun)
    if pieces is None or is_partial(fun) or not isinstance(pieces.inside, _WRAPPERS):
        return fun, args
    return pieces.inside, (*pieces.args, *args)


@hiding_frames
def num_traces(fun: Any) -> int:  # checked below, with a message that helps
    """How many times `fun` has been traced at the top level or under eager
    transforms (not nested in staged traces, nor a nested trace that a top-level
    call reuses), over all wrappers of one function with equal options: they share
    their caches, as `jax.jit`'s do (`filter_jit(f)(x)` in a loop traces once).

    **Arguments:**

    - `fun`: a `filter_jit`-wrapped function (a method may be given read from an
        instance, `model.__call__`, or through its class), or a `filterjit.jit`
        one: for that, the entries in `jax.jit`'s cache (traces since it was last
        cleared).

    **Returns:**

    The number of traces so far.

    **Raises:**

    - `TypeError`: `fun` is neither a `filter_jit` nor a `filterjit.jit` function.
    """
    fun, _ = _unbind(fun, ())
    if isinstance(fun, JitWrapper):
        if (size := jit_cache_size(fun._outside)) is None:
            raise TypeError(
                "num_traces: this version of JAX does not say how many times "
                f"jax.jit traced {name_of(fun._function)}."
            )
        return size
    if not isinstance(fun, FilterJitWrapper):
        raise TypeError(
            "num_traces expects a filter_jit-wrapped function (or a filterjit.jit "
            f"one), but got {fun!r}."
        )
    return fun._dispatcher.trace_log.count


def clear_caches() -> None:
    """Clears the caches of every `filter_jit`-wrapped function: the next call of
    each traces again. Trace counts are kept."""
    clear_all()
