"""The `filter_jit` wrapper: a value holding a function and its options, which
hands each call to the dispatcher shared by every wrapper of that function."""

import contextlib
import functools as ft
import inspect
import sys
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, Concatenate, Generic, overload, ParamSpec, TypeVar

import jax.tree_util as jtu

from . import _trace, _tracebacks
from ._aot import Lowered, Specialisation, Traced
from ._diagnostics import Explanation
from ._dispatch import Dispatcher
from ._fastpath import Hit, MISS
from ._function import (
    as_held,
    attribute_reader,
    class_read,
    ClassAttributes,
    is_partial,
    name_of,
    signature_of,
    unwrapped,
)
from ._level import STAGED, TOP
from ._options import check_donated_names, DonateOption, make_options, Options
from ._output import finish
from ._owners import dispatcher_for


_P = ParamSpec("_P")
_Q = ParamSpec("_Q")
_R = TypeVar("_R")
_S = TypeVar("_S")
_W = TypeVar("_W", bound="Wrapper[Any, Any]")


def _metadata(fun: object) -> dict[str, Any]:
    """As `functools.wraps` copies it, and where the annotations' names resolve
    (for jaxtyping's `jaxtyped`)."""
    read = attribute_reader(fun)
    partial = is_partial(fun)
    inner = fun if read("__func__", None) is None and not partial else unwrapped(fun)
    read_inner = read if inner is fun else ft.partial(getattr, inner)
    namespace = read_inner("__globals__", None)
    if namespace is None:  # a callable object: its class's module
        module = sys.modules.get(getattr(type(inner), "__module__", ""))
        namespace = vars(module) if module is not None else {}
    own_name = None if partial else read("__qualname__", None)
    qualname = own_name or (name_of(fun) if partial else type(fun).__qualname__)
    return {
        "__name__": read("__name__", None) or qualname,
        "__qualname__": qualname,
        "__doc__": read("__doc__", None),
        "__module__": read("__module__", None) or __name__,
        "__annotations__": read("__annotations__", {}),
        "__globals__": namespace,
    }


def _copy_metadata(wrapper: Any, fun: object, by_class: ClassAttributes | None) -> None:
    # As functools.wraps does; the wrapper JAX unflattens may hold a placeholder.
    wrapper.__wrapped__ = fun
    metadata = _metadata(fun) if by_class is None else by_class.metadata
    if not metadata:  # its class's (`class_read`), read once
        metadata.update(_metadata(fun))
    wrapper.__dict__.update(metadata)


def level_switch(reader: _trace.LevelReader) -> Callable[..., Any]:
    """The wrapper's `__call__`, the level found with `reader`: inside
    `jax.disable_jit()` the function itself; else the dispatcher's hit at that
    level, and where it reads no call (`MISS`), the dispatcher's reference path.
    filterjit's frames are hidden from what it raises, as JAX hides its own."""
    jit_disabled, current, top_type, staged_type, level_of = reader
    top, staged, miss = TOP, STAGED, MISS

    def __call__(self: Any, /, *args: object, **kwargs: object) -> Any:
        __tracebackhide__ = True  # noqa: F841 - pytest hides this frame
        try:
            if jit_disabled():
                return self._fun(*args, **kwargs)
            trace = current()
            if type(trace) is top_type:
                level = top
            elif type(trace) is staged_type:
                level = staged
            else:
                level = level_of(trace)
            out = self._hits[level](self._fun, args, kwargs)
            if out is miss:
                return self._dispatcher.call(level, self._fun, args, kwargs)
            return out
        except Exception as error:
            _tracebacks.hide_frames(error)
            raise

    return __call__


def is_module_global(wrapper: object) -> bool:
    """Whether `wrapper` is what its `__module__` and `__qualname__` name (a function
    or class attribute there), so that pickle can save it by reference."""
    found: Any = sys.modules.get(getattr(wrapper, "__module__", None) or "")
    for name in str(getattr(wrapper, "__qualname__", "<locals>")).split("."):
        found = getattr(found, name, None)
    return found is wrapper


class Wrapper(Generic[_P, _R]):
    """Typed as the function it wraps, and bound as a method: both wrappers are."""

    __slots__ = ()

    if typing.TYPE_CHECKING:

        def __call__(self, /, *args: _P.args, **kwargs: _P.kwargs) -> _R: ...

    @overload
    def __get__(self: "_W", instance: None, owner: type | None = None) -> "_W": ...

    @overload
    def __get__(
        self: "Wrapper[Concatenate[_S, _Q], _R]",
        instance: _S,
        owner: type | None = None,
    ) -> Callable[_Q, _R]: ...

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        # Called as `self(instance, ...)`: `instance` is partitioned as an argument.
        return self if instance is None else types.MethodType(self, instance)


class FilterJitWrapper(Wrapper[_P, _R]):
    """A function compiled with `filter_jit`. See `filterjit.filter_jit`.

    A pytree whose leaves are the function's (an `eqx.Module`'s arrays, say), and a
    value: it can be copied and pickled wherever its function can.
    """

    _fun: Callable[_P, _R]
    _options: Options
    _dispatcher: Dispatcher
    _hits: list[Hit]  # the dispatcher's, per level
    # The function's metadata, as functools.wraps copies it (`_copy_metadata`).
    __wrapped__: Callable[_P, _R]
    __name__: str
    __qualname__: str
    __globals__: dict[str, Any]

    def __init__(self, fun: Callable[_P, _R], options: Options):
        by_class = class_read(fun)  # asked once: the owner's key and metadata read it
        held = fun if by_class is not None else as_held(fun)  # what as_held makes of it
        self._fun = held
        self._options = options
        self._dispatcher = dispatcher_for(held, options, by_class is not None)
        if isinstance(options.donate, tuple):
            check_donated_names(self._dispatcher.function, options.donate)
        self._dispatcher.trace_log.made_for(held)
        self._hits = self._dispatcher.hits
        _copy_metadata(self, fun, by_class)  # `__wrapped__`: the callable as given

    if not typing.TYPE_CHECKING:
        __call__ = level_switch(_trace.level_reader)

    def __repr__(self) -> str:
        return f"<filter_jit-wrapped {name_of(self._fun)} at {id(self):#x}>"

    @property
    def __signature__(self) -> inspect.Signature | None:
        # As jax.jit's object gives it, also to `follow_wrapped=False` (which takes
        # the wrapper, a descriptor, for a builtin): the function's.
        return signature_of(self._fun, follow_wrapped=True)

    def __reduce__(self) -> str | tuple[Any, ...]:
        # By reference where it is its module's global, as functions are; else by
        # value (cloudpickle), the caches found again from the function and options.
        if is_module_global(self):
            return self.__qualname__
        return FilterJitWrapper, (self._fun, self._options)

    @_tracebacks.hiding_frames
    def lower(self, /, *args: _P.args, **kwargs: _P.kwargs) -> Lowered:
        """Lowers the function for these arguments, as `jax.jit(...).lower`.

        Arrays may be given as `jax.ShapeDtypeStruct`s. Every other leaf is static
        and compiled in: the `Compiled` object raises if called with different
        static values.

        **Arguments:**

        - `*args`, `**kwargs`: the arguments of a call of the function, with
            `jax.ShapeDtypeStruct`s for arrays if you like.

        **Returns:**

        A `Lowered`, with `.as_text()` and `.compile()`.
        """
        called = Specialisation(self._dispatcher, self._fun, *args, **kwargs)
        return Lowered(called.jitted.lower(*called.dynamic), called)

    @_tracebacks.hiding_frames
    def trace(self, /, *args: _P.args, **kwargs: _P.kwargs) -> Traced:
        """Traces the function for these arguments, as `jax.jit(...).trace`.

        **Arguments:**

        - `*args`, `**kwargs`: the arguments of a call of the function, with
            `jax.ShapeDtypeStruct`s for arrays if you like.

        **Returns:**

        A `Traced`, with `.jaxpr`, `.out_info` and `.lower()`.
        """
        called = Specialisation(self._dispatcher, self._fun, *args, **kwargs)
        return Traced(called.jitted.trace(*called.dynamic), called)

    @_tracebacks.hiding_frames
    def eval_shape(self, /, *args: _P.args, **kwargs: _P.kwargs) -> Any:
        """The output's shapes and dtypes, as `jax.eval_shape`, without compiling.

        **Arguments:**

        - `*args`, `**kwargs`: the arguments of a call of the function, with
            `jax.ShapeDtypeStruct`s for arrays if you like.

        **Returns:**

        The output, with traced leaves as `jax.ShapeDtypeStruct`s and every other
        leaf as the function returned it.
        """
        called = Specialisation(self._dispatcher, self._fun, *args, **kwargs)
        return finish(called.jitted.eval_shape(*called.dynamic), called.leaves)

    def _explain(
        self, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> Explanation:
        return self._dispatcher.explain(_trace.trace_level(), self._fun, args, kwargs)


def _unflatten(
    options: Options, children: Iterable[object]
) -> FilterJitWrapper[..., Any]:
    # JAX unflattens with placeholders too (None, object()): nothing is checked.
    wrapper = object.__new__(FilterJitWrapper)
    (fun,) = children
    wrapper.__dict__.update(_fun=fun, _options=options)
    by_class = class_read(fun)
    _copy_metadata(wrapper, fun, by_class)
    with contextlib.suppress(Exception):  # a placeholder rather than a function
        wrapper._dispatcher = dispatcher_for(fun, options, by_class is not None)
        wrapper._hits = wrapper._dispatcher.hits
    return wrapper


jtu.register_pytree_node(
    FilterJitWrapper,
    lambda wrapper: ((wrapper._fun,), wrapper._options),
    _unflatten,  # pyright: ignore[reportArgumentType]
)


@overload
def filter_jit(
    fun: Callable[_P, _R],
    *,
    donate: DonateOption = "none",
    inline: Any = False,  # a bool, or a jax.Inline member (jax >= 0.11)
    **jitkwargs: Any,
) -> FilterJitWrapper[_P, _R]: ...


@overload
def filter_jit(
    fun: None = None,
    *,
    donate: DonateOption = "none",
    inline: Any = False,
    **jitkwargs: Any,
) -> Callable[[Callable[_P, _R]], FilterJitWrapper[_P, _R]]: ...


def filter_jit(
    # `Any`: checked below, saying what to do; no runtime type checker may pre-empt.
    # (And the API page shows, for each `Any` here, the overloads' types.)
    fun: Any = None,
    *,
    donate: Any = "none",
    inline: Any = False,
    **jitkwargs: Any,
) -> Any:
    """Compiles `fun` like `jax.jit`, tracing its array leaves and keeping every
    other leaf static; and when called inside another trace, changes nothing.

    At the top level (and under eager `grad`/`vjp`/`jvp`/`vmap`), JAX arrays,
    NumPy arrays and NumPy scalars anywhere in the arguments are traced, and every
    other leaf (Python `bool`/`int`/`float`/`complex` included) is static. A call
    inside a staged computation (an outer `jax.jit`, a `lax.scan` body,
    `jax.checkpoint`, `make_jaxpr`, ...) traces only the leaves that are already
    tracers: concrete arrays and Python values reach `fun` unchanged, exactly as
    they would without the decorator, so decorating a function never changes what
    a program computes, whether it can be differentiated, or what is known at
    trace time.

    Outputs that are traced come back as arrays; anything else `fun` returns comes
    back unchanged.

    **Arguments:**

    - `fun`: the function to compile. It may be a pytree (an `eqx.Module`, a
        `jax.tree_util.Partial`), whose leaves are partitioned like arguments.
        Omit it to use `filter_jit(...)` as a decorator factory.
    - `donate`: which argument buffers to donate at the top level: `"none"`,
        `"all"`, `"all-except-first"` (these two silence JAX's warning about
        unusable donations), `"warn"`, `"warn-except-first"` (the same, warning),
        or a tuple of parameter names. Ignored when nested.
    - `inline`: inline a nested call into the outer jaxpr rather than emitting a
        `jit` equation. Changes structure only, never results.
    - `jitkwargs`: passed on to `jax.jit` (`keep_unused`, `compiler_options`,
        `device`, `backend`), except `in_shardings`, a pytree prefix of the
        positional arguments whose entries on static leaves are ignored, and
        `out_shardings`, a prefix of the output; both apply at the top level only,
        as do `compiler_options`.
        `static_argnums`, `static_argnames`, `donate_argnums` and
        `donate_argnames` are rejected, with what to use instead.

    **Returns:**

    A `FilterJitWrapper` with the signature of `fun`, usable as a method; without
    `fun`, a decorator that makes one.

    **Raises:**

    - `TypeError`: `fun` is not callable, or a keyword is not one of `jax.jit`'s.
    - `ValueError`: `donate` or `inline` is not an option, `donate` names a
        parameter that no call can pass, or a keyword is one that `filter_jit`
        replaces (`static_argnums`, `donate_argnums`, ...; the message says what
        to use instead).

    !!! example

        ```python
        @filterjit.filter_jit
        def f(init, lower):
            return jax.lax.fori_loop(lower, 1, lambda _, y: y + 1, init)

        jax.jit(lambda: jax.grad(f)(0.0, np.int32(0)))()  # 1.0
        ```
    """
    if type(donate) is str and donate == "none" and inline is False and not jitkwargs:
        options = _DEFAULT_OPTIONS  # checked once (libraries wrap on every call)
    else:
        options = make_options(donate=donate, inline=inline, **jitkwargs)
    if fun is None:
        return ft.partial(_decorate, options)  # pyright: ignore[reportReturnType]
    return _decorate(options, fun)


_DEFAULT_OPTIONS = make_options()


def _decorate(options: Options, fun: object, caller: str = "filter_jit") -> Any:
    if not callable(fun):
        raise TypeError(
            f"{caller} expects a callable, but got {fun!r} of type "
            f"`{type(fun).__qualname__}`. Use it as `@filter_jit` or "
            "`filter_jit(function)`."
        )
    return FilterJitWrapper(fun, options)
