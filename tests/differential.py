"""The differential harness: one table of contexts, one comparison of results,
one capture of outcomes, for every suite that checks filterjit against a
reference (the undecorated function nested; `jax.jit` or `eqx.filter_jit` at the
top level).

- `CONTEXTS`: where a call runs (the top level, eager transforms, staged
  computations), each `apply(g, x)` running `g` on the array `x` there.
- `mismatch` / `assert_tree_equal`: how two results differ, if they do;
  `assert_tree_allclose`, the same comparison to float tolerance, any kind of
  array for any other.
- `outcome` / `agree`: a call's result or error, and whether two outcomes agree. A
  capture takes only the errors a program raises (from inside JAX, Equinox or
  filterjit, or of a type the test says its function raises); any other error is
  the test's own (a name, an assertion, a call of the wrong arity in the test's
  code) and is raised, so that a broken test never passes as two equal failures.
"""

import dataclasses
import math
import os
import re
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import equinox
import hypothesis.errors
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.core import Tracer

import filterjit
from filterjit import _fastpath


# The fast path's own tests: nothing to check where FILTERJIT_FASTPATH=0.
needs_fast_path = pytest.mark.skipif(
    not _fastpath.ENABLED, reason="the fast path is off (FILTERJIT_FASTPATH=0)"
)


# ------------------------------------------------------------------- contexts

Fn = Callable[[jax.Array], Any]


@dataclasses.dataclass(frozen=True)
class Context:
    name: str
    # Whether `g` runs inside a staged computation (a DynamicJaxprTrace).
    staged: bool
    apply: Callable[[Fn, jax.Array], Any]


def _batch(x: jax.Array) -> jax.Array:
    return jnp.stack([x, 2 * x])


def _summed(g: Fn) -> Fn:
    return lambda x: jnp.sum(g(x))


def _scan(g: Fn, x: jax.Array) -> jax.Array:
    return lax.scan(lambda carry, _: (g(carry), None), x, None, length=2)[0]


def _while(g: Fn, x: jax.Array) -> jax.Array:
    def body(state: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        i, y = state
        return i + 1, g(y)

    return lax.while_loop(lambda state: state[0] < 2, body, (jnp.asarray(0), x))[1]


def _cond(g: Fn, x: jax.Array) -> jax.Array:
    # Under jit, so that the predicate is a tracer.
    return lax.cond(jnp.sum(x) > 0, g, lambda y: -y, x)


def _jvp(g: Fn, x: jax.Array) -> Any:
    return jax.jvp(g, (x,), (jnp.ones_like(x),))


def _vjp(g: Fn, x: jax.Array) -> Any:
    y, pullback = jax.vjp(g, x)
    return y, pullback(jnp.ones_like(y))


def _jit_in_jit(g: Fn, x: jax.Array) -> jax.Array:
    middle = jax.jit(lambda y: g(y) + 1)
    return jax.jit(lambda y: middle(y) * 2)(x)


CONTEXTS: tuple[Context, ...] = (
    Context("jit", True, lambda g, x: jax.jit(g)(x)),
    Context("jit(grad)", True, lambda g, x: jax.jit(jax.grad(_summed(g)))(x)),
    Context("jit(vmap)", True, lambda g, x: jax.jit(jax.vmap(g))(_batch(x))),
    Context("vmap(jit)", True, lambda g, x: jax.vmap(jax.jit(g))(_batch(x))),
    Context(
        "jit(vmap(grad))",
        True,
        lambda g, x: jax.jit(jax.vmap(jax.grad(_summed(g))))(_batch(x)),
    ),
    Context("scan body", True, _scan),
    Context("jit(scan body)", True, lambda g, x: jax.jit(lambda y: _scan(g, y))(x)),
    Context(
        "grad(scan body)",
        True,
        lambda g, x: jax.grad(lambda y: jnp.sum(_scan(g, y)))(x),
    ),
    Context("while body", True, _while),
    Context("cond branch", True, lambda g, x: jax.jit(lambda y: _cond(g, y))(x)),
    Context(
        "jit(grad(checkpoint))",
        True,
        lambda g, x: jax.jit(jax.grad(jax.checkpoint(_summed(g))))(x),
    ),
    Context("eval_shape", True, lambda g, x: jax.eval_shape(g, x)),
    Context("jit in jit", True, _jit_in_jit),
    Context("jit(jvp)", True, lambda g, x: jax.jit(lambda y: _jvp(g, y))(x)),
    Context("jit(vjp)", True, lambda g, x: jax.jit(lambda y: _vjp(g, y))(x)),
    Context("jit(hessian)", True, lambda g, x: jax.jit(jax.hessian(_summed(g)))(x)),
    Context("top level", False, lambda g, x: g(x)),
    Context("jvp", False, _jvp),
    Context("vjp", False, _vjp),
    Context("hessian", False, lambda g, x: jax.hessian(_summed(g))(x)),
    Context("grad", False, lambda g, x: jax.grad(_summed(g))(x)),
    Context("vmap", False, lambda g, x: jax.vmap(g)(_batch(x))),
)

_BY_NAME = {context.name: context for context in CONTEXTS}


def contexts(*names: str) -> tuple[Context, ...]:
    """The contexts of `CONTEXTS` named, in that order."""
    return tuple(_BY_NAME[name] for name in names)


def _first_array(out: Any) -> jax.Array:
    return next(leaf for leaf in jax.tree.leaves(out) if isinstance(leaf, jax.Array))


def run_in(context: Context, call: Callable[[jax.Array], Any], x: jax.Array) -> Any:
    """`call(x)` in `context`, whose output may be any pytree: at the top level
    the whole output; elsewhere the context's result of the output's first array,
    and the other leaves of each call's output (the static outputs a nested call
    hands to the code around it)."""
    if context.name == "top level":
        return call(x)
    others: list[Any] = []

    def g(y: jax.Array) -> jax.Array:
        out = call(y)
        leaves = jax.tree.leaves(out)
        others.append([leaf for leaf in leaves if not isinstance(leaf, jax.Array)])
        return _first_array(out)

    return context.apply(g, x), others


# ------------------------------------------------------------------- comparing


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic)


def _as_float(x: Any) -> np.ndarray:
    array = np.asarray(x)
    return array.astype(np.complex128 if array.dtype.kind == "c" else np.float64)


def _array_mismatch(a: Any, e: Any, how: "_How") -> str | None:
    if isinstance(e, jax.ShapeDtypeStruct):
        same = isinstance(a, jax.ShapeDtypeStruct)
        if not (same and a.shape == e.shape and a.dtype == e.dtype):
            return "another shape or dtype"
        return None
    if not _is_array(a):
        return "not an array"
    if how.traced and not (isinstance(a, jax.Array) and not isinstance(a, Tracer)):
        return "not a JAX array (traced: it must come back as one)"
    if how.kinds and not how.traced:
        if isinstance(e, jax.Array) != isinstance(a, jax.Array):
            return "another kind of array (a JAX array for a NumPy one, or back)"
        if not isinstance(e, jax.Array) and type(a) is not type(e):
            return "another NumPy type"
    a_type, e_type = jax.typeof(a), jax.typeof(e)
    if (a_type.shape, a_type.dtype) != (e_type.shape, e_type.dtype):
        return "another shape or dtype"
    if how.weak_types and a_type.weak_type != e_type.weak_type:
        return "another weak type"
    a_value, e_value = _as_float(a), _as_float(e)
    if how.rtol or how.atol:
        close = np.allclose(
            a_value, e_value, rtol=how.rtol, atol=how.atol, equal_nan=True
        )
        return None if close else "other values"
    if not np.array_equal(a_value, e_value, equal_nan=True):
        return "other values"
    if not how.signed_zeros:
        return None
    for part_a, part_e in zip(
        (np.real(a_value), np.imag(a_value)), (np.real(e_value), np.imag(e_value))
    ):
        if not np.array_equal(np.signbit(part_a), np.signbit(part_e)):
            return "other signs of zero"
    return None


def _static_mismatch(a: Any, e: Any) -> str | None:
    if type(a) is not type(e):
        return "another type"
    if a != a and e != e:  # nan
        return None
    if a != e:
        return "not equal"
    if type(e) is float and math.copysign(1.0, a) != math.copysign(1.0, e):
        return "another sign of zero"
    return None


_IMMUTABLE = (int, float, complex, bool, str, bytes, type(None))


@dataclasses.dataclass(frozen=True)
class _How:
    traced: bool = False
    identical: bool = False
    kinds: bool = True
    weak_types: bool = True
    signed_zeros: bool = True
    rtol: float = 0.0
    atol: float = 0.0


def mismatch(actual: Any, expected: Any, **how: Any) -> str | None:
    """How `actual` differs from `expected`, or `None`: the same structure; each
    array of the same kind where `kinds` (a JAX array where `expected`'s is, the
    same NumPy type where it is NumPy), or where `traced` a JAX array, not a
    tracer, for any array; of the same shape and dtype, weak type where
    `weak_types`, and values (exactly, nan equal to nan and, where `signed_zeros`,
    -0.0 not to 0.0; or to
    `rtol` and `atol`); each other leaf of the same type and equal (and zero of the
    same sign). Where `identical`, each leaf is the very object expected, but an
    array where `traced`."""
    options = _How(**how)
    a_leaves, a_def = jax.tree.flatten(actual)
    e_leaves, e_def = jax.tree.flatten(expected)
    if a_def != e_def:
        return f"other structures: {a_def} against {e_def}"
    for index, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        array = _is_array(e) or isinstance(e, jax.ShapeDtypeStruct)
        if options.identical and not (array and options.traced):
            # An immutable value's identity is nothing a program relies on (which
            # of two equal floats comes back is not keyed: DESIGN.md, aliasing).
            if type(e) in _IMMUTABLE:
                why = None if a is e else _static_mismatch(a, e)
            else:
                why = None if a is e else "not the same object"
        elif array:
            why = _array_mismatch(a, e, options)
        else:
            why = _static_mismatch(a, e)
        if why is not None:
            return f"leaf {index}: {a!r} against {e!r}: {why}"
    return None


def assert_tree_equal(actual: Any, expected: Any, **how: Any) -> None:
    """`mismatch(actual, expected, **how)` finds no difference."""
    why = mismatch(actual, expected, **how)
    assert why is None, why


def assert_tree_allclose(actual: Any, expected: Any) -> None:
    """Same structure, same leaf types, equal shapes and dtypes, values to a
    relative 1e-6, any kind of array for any other and weak types aside:
    `assert_tree_equal`, loosely."""
    assert_tree_equal(actual, expected, kinds=False, weak_types=False, rtol=1e-6)


# -------------------------------------------------------------------- outcomes

# Where a program's errors come from: JAX, Equinox and filterjit raise them.
_LIBRARIES = tuple(
    os.path.dirname(module.__file__ or "") + os.sep
    for module in (jax, equinox, filterjit, np)
)
# Errors a test's own code raises when it is wrong, wherever they come from.
_TEST_ERRORS = (AssertionError, NameError, hypothesis.errors.HypothesisException)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A call's result, or the error it raised (its type and its message with
    object ids taken out)."""

    value: Any = None
    error: type[BaseException] | None = None
    message: str = ""

    def __str__(self) -> str:
        if self.error is not None:
            first = self.message.splitlines()[0] if self.message else ""
            return f"raises {self.error.__name__}: {first}"
        return f"returns {self.value!r}"


def _raised_by_a_library(error: BaseException) -> bool:
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_LIBRARIES)


def outcome(
    thunk: Callable[[], Any], raises: Sequence[type[BaseException]] = ()
) -> Outcome:
    """What `thunk()` returns (waited for), or the error it raises where that is
    a program's error: raised from inside JAX, Equinox, NumPy or filterjit, or of
    a type in `raises` (what the test's function raises on purpose). Any other
    error, and an assertion or a missing name from anywhere, is the test's own:
    raised here."""
    # With JAX's frames kept in tracebacks, to see where an error was raised.
    filtering = getattr(jax.config, "jax_traceback_filtering")
    jax.config.update("jax_traceback_filtering", "off")
    try:
        return Outcome(jax.block_until_ready(thunk()))
    except _TEST_ERRORS:
        raise
    except Exception as error:
        if not (isinstance(error, tuple(raises)) or _raised_by_a_library(error)):
            raise
        message = re.sub("0x[0-9a-f]+", "0x…", str(error))
        return Outcome(error=type(error), message=message)
    finally:
        jax.config.update("jax_traceback_filtering", filtering)


def agree(
    actual: Outcome, expected: Outcome, *, messages: bool = False, **how: Any
) -> str | None:
    """How `actual` disagrees with `expected`, or `None`: both raise errors of one
    type (and, where `messages`, one message), or both return results that
    `mismatch(..., **how)` finds no difference between."""
    if actual.error is not None or expected.error is not None:
        if actual.error is not expected.error:
            return f"{actual} against {expected}"
        if messages and actual.message != expected.message:
            return f"{actual} against {expected}: another message"
        return None
    why = mismatch(actual.value, expected.value, **how)
    return None if why is None else f"{why}\n  {actual}\n  against {expected}"


def assert_agree(actual: Outcome, expected: Outcome, **how: Any) -> None:
    why = agree(actual, expected, **how)
    assert why is None, why


# JAX raises these from C++ too (jax.jit refusing an unhashable static, say), where
# no frame of JAX's is in the traceback: a program's errors all the same.
JAX_ERRORS = (TypeError, ValueError)


def _made(value: Any) -> Any:
    return "a callable" if callable(value) else value


def assert_same_outcome(
    ours: Callable[[], Any],
    theirs: Callable[[], Any],
    raises: Sequence[type[BaseException]] = JAX_ERRORS,
) -> None:
    """`ours()` and `theirs()` return equal trees (any two callables count as
    equal: each made a wrapper) or raise one error with one message."""
    assert_agree(
        outcome(lambda: _made(ours()), raises),
        outcome(lambda: _made(theirs()), raises),
        messages=True,
    )
