"""`filterjit.jit`: `jax.jit` itself outside staged traces; inside one, the nested
no-op of `filter_jit`."""

import functools as ft
import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Any, overload

import jax
import jax.tree_util as jtu

from . import _trace, _tracebacks
from ._diagnostics import Explanation, Row, row
from ._function import Function
from ._jit import _P, _R, FilterJitWrapper, is_module_global, Wrapper
from ._level import Level, STAGED
from ._options import make_options, UNSPECIFIED


# The jax.jit keywords that mean the same nested. Not the others: nested, every leaf
# not a tracer is static, nothing is donated, shardings and compiler options are the
# outer program's.
_NESTED_KEYWORDS = frozenset(("keep_unused", "inline", "device", "backend"))


def level_switch(reader: _trace.LevelReader) -> Callable[..., Any]:
    """`JitWrapper.__call__`, the level found with `reader`: `jax.jit`'s object
    outside staged traces (it sees `jax.disable_jit()` itself), the wrapper's
    `_staged` inside one. filterjit's frames are hidden from what it raises."""
    _, current, top_type, staged_type, level_of = reader

    def __call__(self: Any, /, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # noqa: F841 - pytest hides this frame
        try:
            trace = current()
            if type(trace) is top_type:  # most calls
                return self._outside(*args, **kwargs)
            if type(trace) is staged_type or level_of(trace) == STAGED:
                return self._staged(*args, **kwargs)
            return self._outside(*args, **kwargs)
        except Exception as error:
            _tracebacks.hide_frames(error)
            raise

    return __call__


class JitWrapper(Wrapper[_P, _R]):
    """A function compiled with `filterjit.jit`: `jax.jit`'s object at the top level
    and under eager transforms, `filter_jit`'s nested call inside a staged trace.
    See `filterjit.jit`."""

    # Its `__dict__` is what `jax.jit`'s object holds in its own; its methods are on
    # its type, so that a transform that copies the `__dict__` (`jax.vmap`,
    # `jax.grad` and `jax.jit` do) copies none.

    __slots__ = (
        "_outside",
        "_function",
        "_record",
        "_jit_kwargs",
        "_nested",
        "__dict__",
        "__weakref__",
    )
    _outside: Any  # the `jax.jit` object
    _function: Callable[_P, _R]
    _record: Function | None  # for `explain`: its name and parameters
    _jit_kwargs: dict[str, Any]
    _nested: FilterJitWrapper[_P, _R] | None  # made on first use: most never nest

    # `fun: Any`: jax.jit checks it, and no runtime type checker must pre-empt it.
    def __init__(self, fun: Any, jit_kwargs: dict[str, Any]):
        self._outside = jax.jit(fun, **jit_kwargs)
        self._function = fun
        # Made by the first `explain`: a wrapper made anew at every call (as
        # libraries write `jit(f)(x)`) reads no signature beyond jax.jit's own.
        self._record = None
        self._jit_kwargs = jit_kwargs
        self._nested = None
        self.__dict__.update(vars(self._outside))

    if not typing.TYPE_CHECKING:
        __call__ = level_switch(_trace.level_reader)

    def _staged(self, /, *args: Any, **kwargs: Any) -> Any:
        return self._nested_wrapper()(*args, **kwargs)

    def _nested_wrapper(self) -> FilterJitWrapper[_P, _R]:
        # Its options are made here, at the first nested call: where jax.jit reads
        # `inline` (while staging), not before.
        if self._nested is None:
            nested = {
                k: v for k, v in self._jit_kwargs.items() if k in _NESTED_KEYWORDS
            }
            # As jax.jit reads it: a member of `jax.Inline` (jax >= 0.11) as it is,
            # anything else by its truth.
            modes: Any = getattr(jax, "Inline", None)
            inline = nested.get("inline")
            if "inline" in nested and (modes is None or not isinstance(inline, modes)):
                nested["inline"] = bool(inline)
            self._nested = FilterJitWrapper(self._function, make_options(**nested))
        return self._nested

    def __repr__(self) -> str:
        return repr(self._outside)

    @property
    def __signature__(self) -> inspect.Signature:
        # jax.jit's object's, on the type as there, so that transforms copy none.
        return self._outside.__signature__

    def __reduce__(self) -> Any:
        # By reference where it is a module's global, as functions are; else (a
        # local function, for cloudpickle) by its function and keywords.
        if is_module_global(self):
            return self.__dict__["__qualname__"]
        return JitWrapper, (self._function, self._jit_kwargs)

    def __getstate__(self) -> Any:
        # jax.jit's (`function_name`, ...); pickling goes through `__reduce__`.
        return self._outside.__getstate__()

    def lower(self, /, *args: _P.args, **kwargs: _P.kwargs) -> jax.stages.Lowered:
        """`jax.jit(fun, **jit_kwargs).lower(*args, **kwargs)`."""
        return self._outside.lower(*args, **kwargs)

    def trace(self, /, *args: _P.args, **kwargs: _P.kwargs) -> jax.stages.Traced:
        """`jax.jit(fun, **jit_kwargs).trace(*args, **kwargs)`."""
        return self._outside.trace(*args, **kwargs)

    def eval_shape(self, /, *args: _P.args, **kwargs: _P.kwargs) -> Any:
        """`jax.jit(fun, **jit_kwargs).eval_shape(*args, **kwargs)`."""
        return self._outside.eval_shape(*args, **kwargs)

    def clear_cache(self) -> None:
        """Clears `jax.jit`'s cache of this function, and its nested calls' cache."""
        self._outside.clear_cache()
        if self._nested is not None:
            self._nested._dispatcher.clear()

    def _explain(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Explanation:
        level = _trace.trace_level()
        if level == STAGED:
            return self._nested_wrapper()._explain(args, kwargs)
        # jax.jit's roles: an argument is static as a whole, or its leaves traced.
        if self._record is None:  # read once, here alone (see `__init__`)
            self._record = Function(self._function)
        record = self._record
        numbers, names = _static_arguments(record.parameters, self._jit_kwargs)
        numbers = {n % len(args) if n < 0 else n for n in numbers if args}
        named = record.label
        arguments = [(named(i), i in numbers, arg) for i, arg in enumerate(args)]
        arguments += [(name, name in names, arg) for name, arg in kwargs.items()]
        rows = []
        for label, static, arg in arguments:
            if static:
                rows.append(row(label, "static", arg))
                continue
            for path, leaf in jtu.tree_flatten_with_path(arg)[0]:
                where = label + jtu.keystr(path)
                try:
                    rows.append(row(where, "traced", leaf))
                except TypeError:  # not a JAX type: jax.jit raises, as it says
                    text = f"{type(leaf).__name__}: not a JAX type"
                    rows.append(Row(where, "traced", text, type(leaf)))
        level_name = Level(level).description
        return Explanation(record.name, level_name, rows, None, decorator="jit")

    # jax.jit's private methods, which JAX's tests and some libraries call.
    def _cache_size(self) -> int:
        return self._outside._cache_size()

    def _clear_cache(self) -> None:
        self._outside._clear_cache()

    @property
    def _cache_miss(self) -> Any:
        return self._outside._cache_miss


def _as_tuple(value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int | str) else tuple(value)


def _static_arguments(
    parameters: Sequence[inspect.Parameter], jit_kwargs: dict[str, Any]
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """`static_argnums` and `static_argnames` as `jax.jit` infers them: where one
    alone is given, the other from the parameters that take both."""
    given = [jit_kwargs.get(k) for k in ("static_argnums", "static_argnames")]
    numbers, names = map(_as_tuple, given)
    both = [
        (i, p.name)
        for i, p in enumerate(parameters)
        if p.kind is p.POSITIONAL_OR_KEYWORD
    ]
    if given[0] is None:
        numbers = tuple(i for i, name in both if name in names)
    elif given[1] is None:
        names = tuple(name for i, name in both if i in numbers)
    return numbers, names


@overload
def jit(fun: Callable[_P, _R], /, **jit_kwargs: Any) -> JitWrapper[_P, _R]: ...


@overload
def jit(**jit_kwargs: Any) -> Callable[[Callable[_P, _R]], JitWrapper[_P, _R]]: ...


def jit(fun: Any = UNSPECIFIED, /, **jit_kwargs: Any) -> Any:
    """`jax.jit`, whose nested calls are semantic no-ops.

    At the top level and under eager transforms (`jax.grad`, `jax.vmap`, ... not
    inside a `jax.jit`), a call is a call of `jax.jit(fun, **jit_kwargs)`: the same
    tracing, caching, errors, donation and shardings, behind a check of the level.

    Inside a staged trace (an outer `jax.jit`, a `lax.scan` body, ...), a call is
    `filterjit.filter_jit`'s nested call: only leaves that are tracers already are
    traced; Python values, NumPy values and concrete arrays reach `fun` unchanged,
    and what it returns that is not a traced array comes back as it was returned,
    so the decorator changes nothing the program computes. Donation, shardings and
    compiler options do not apply there; `keep_unused` and `inline` do.

    **Arguments:**

    - `fun`: the function to compile. Omit it to use `jit(**jit_kwargs)` as a
        decorator.
    - `jit_kwargs`: `jax.jit`'s keyword arguments, checked by `jax.jit` itself
        (also without `fun`).

    **Returns:**

    A `JitWrapper` with the signature of `fun`, usable as a method.

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
    if fun is UNSPECIFIED:  # as jax.jit(**jit_kwargs): a decorator
        jax.jit(**jit_kwargs)  # raises now, as jax.jit does, for an unknown keyword
        return ft.partial(jit, **jit_kwargs)
    return JitWrapper(fun, jit_kwargs)


# jax.jit checks the arguments: a runtime type checker that binds them first (with
# `inspect`, which refuses `jit(fun=f)` where Python passes `fun` in `jit_kwargs`)
# must not pre-empt its errors.
jit.__no_type_check__ = True  # pyright: ignore[reportFunctionMemberAccess]
