"""`patch_equinox`: Equinox's `filter_jit` replaced by filterjit's for every caller,
including the libraries built on Equinox (diffrax, optimistix, lineax), and its undo."""

import dataclasses
import functools as ft
import gc
import importlib
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import jax.tree_util as jtu

from ._diagnostics import qualified_name
from ._donated import user_frame
from ._jit import _decorate, filter_jit
from ._options import DonateOption, make_options, UNSPECIFIED
from ._tracebacks import hiding_frames


# Equinox's wrapper keeps `donate` as (filter_warning, donate_first, donate_rest).
_DONATE: dict[tuple[bool, bool, bool], DonateOption] = {
    (True, True, True): "all",
    (True, False, True): "all-except-first",
    (False, True, True): "warn",
    (False, False, True): "warn-except-first",
    (False, False, False): "none",
}


def equinox_filter_jit(
    fun: Any = UNSPECIFIED, *, donate: Any = "none", **jitkwargs: Any
) -> Any:
    """`equinox.filter_jit` under [`filterjit.patch_equinox`][]: `filterjit.filter_jit`
    with Equinox's meaning of `donate`: "first" is the call's first argument, and
    every option but `"none"` donates the function's own arrays too where Equinox
    traces them (an `eqx.Module`'s, a `jax.tree_util.Partial`'s, a Module's bound
    method's `self`; not a `functools.partial`'s, nor another class's bound
    method's, which Equinox holds static). Omit `fun` for a decorator factory."""
    if fun is UNSPECIFIED:
        make_options(donate=donate, **jitkwargs)  # raises now for a bad keyword
        return ft.partial(equinox_filter_jit, donate=donate, **jitkwargs)
    wrapper: Any
    if type(donate) is str and donate == "none" and fun is not None:
        # No donation: filterjit's own options.
        wrapper = filter_jit(fun, **jitkwargs)
    else:
        options = make_options(donate=donate, **jitkwargs)
        if isinstance(donate, str):
            # As Equinox means `donate`: "first" is the call's first argument, and
            # it traces (so donates) the arrays of a function that is a pytree node.
            function_is_node = not jtu.treedef_is_leaf(jtu.tree_structure(fun))
            options = dataclasses.replace(
                options, receiver_is_argument=False, donate_function=function_is_node
            )
        wrapper = _decorate(options, fun)
    # No `RetraceWarning`, as Equinox's give none (a library's tests may run with
    # warnings as errors); retraces are still logged where asked for. The log is
    # shared by every wrapper of the function with the same options, filterjit's too.
    wrapper._dispatcher.trace_log.warns = False
    return wrapper


@dataclasses.dataclass(frozen=True)
class EquinoxPatch:
    """What one call of [`filterjit.patch_equinox`][] did.

    **Attributes:**

    - `swapped`: the functions whose Equinox wrapper this call replaced, one entry
        per wrapper, by module and qualified name (`"diffrax._integrate.diffeqsolve"`).
    - `places`: every attribute this call rewrote (`"diffrax.diffeqsolve"`,
        `"equinox.filter_jit"`, ...).
    - `left`: the Equinox wrappers still alive that keep Equinox's jit, each with
        why, and the decorator factories of Equinox's `filter_jit` made before the
        patch (`eqx.filter_jit(donate="all")`); empty when everything was reached.
    """

    swapped: tuple[str, ...]
    places: tuple[str, ...]
    left: tuple[str, ...]


class _State:
    """The patch in force: Equinox's `filter_jit`, and every attribute rewritten."""

    original: Any = None
    swaps: list[tuple[Any, str, Any, Any]] = []  # (owner, attribute, old, new)


def _unwrapped(value: Any) -> Any:
    # By exact type: isinstance would run any object's `__class__` (a proxy's).
    return value.__func__ if type(value) in (staticmethod, classmethod) else value


def _name(wrapper: Any) -> str:
    fun = getattr(wrapper, "__wrapped__", None)
    return qualified_name(fun) or str(getattr(wrapper, "fn", repr(wrapper)))


def _where(owner: Any, attribute: str) -> str:
    if isinstance(owner, types.ModuleType):
        return f"{owner.__name__}.{attribute}"
    return f"{owner.__module__}.{owner.__qualname__}.{attribute}"


def _attributes() -> Iterator[tuple[Any, str, Any]]:
    """`(owner, attribute, value)` for every attribute of every imported module but
    filterjit's, and of every class found in one (nested classes included)."""
    classes: dict[int, type] = {}
    for name, module in list(sys.modules.items()):
        is_module = issubclass(type(module), types.ModuleType)
        if not is_module or name.partition(".")[0] == "filterjit":
            continue
        pending: list[Any] = [module]
        while pending:
            owner = pending.pop()
            for attribute, value in list(vars(owner).items()):
                yield owner, attribute, value
                if issubclass(type(value), type) and id(value) not in classes:
                    classes[id(value)] = value
                    pending.append(value)


def _replacement(wrapper: Any, jit_module: types.ModuleType) -> Any:
    """filterjit's wrapper for Equinox's `wrapper`, or a string saying why none."""
    try:
        flags = (wrapper.filter_warning, wrapper.donate_first, wrapper.donate_rest)
        fun = wrapper.__wrapped__
        cached = wrapper._cached
    except AttributeError:
        return "this version of Equinox's wrapper does not have the expected fields"
    if (donate := _DONATE.get(flags)) is None:
        return f"its donation flags {flags} are not one of Equinox's options"
    # Equinox keeps other jax.jit keywords only in the jax.jit it caches per function
    # and keywords: asking that cache tells (where there were, it adds an unused one).
    if jit_module._filter_jit_cache(fun, {}) is not cached:
        return (
            "it was decorated with jax.jit keywords (`eqx.filter_jit(f, "
            "inline=True)`, say), which Equinox does not keep in a form that can be "
            "read back; decorate it after patch_equinox()"
        )
    return equinox_filter_jit(fun, donate=donate)


def _factory(value: Any, originals: list[Any]) -> bool:
    """Whether `value` is a decorator factory of Equinox's own `filter_jit`."""
    return type(value) is ft.partial and any(value.func is jit for jit in originals)


@hiding_frames
def patch_equinox() -> EquinoxPatch:
    """Makes `equinox.filter_jit` be `filterjit.filter_jit`, for every caller from
    now on, and replaces the functions Equinox has already compiled where they can
    be found.

    - `equinox.filter_jit`, `equinox._jit.filter_jit` and every module global bound
        to it (`from equinox import filter_jit`) become `filterjit.filter_jit` with
        Equinox's meaning of `donate` (below), for code that decorates from now on.
    - Every function already decorated with Equinox's `filter_jit` that is an
        attribute of an imported module or of a class defined in one (a method,
        `staticmethod` or `classmethod`) is replaced, under every name, by
        filterjit's wrapper with the same `donate`: `diffrax.diffeqsolve`,
        `optimistix.root_find` and `lineax.linear_solve` are filterjit's whether
        imported before this call or after it.
    - An Equinox wrapper held anywhere else (a closure, a list, a Module's field)
        or made with `jax.jit` keywords, and a decorator factory made before the
        call (`jit_all = eqx.filter_jit(donate="all")`), are left, and named in a
        warning and in the report's `left`.

    Where the patched `equinox.filter_jit` differs from `filterjit.filter_jit`:
    under `donate`, "first" is the call's first argument rather than a Module's or
    a bound method's `self`, and the function's own arrays (an `eqx.Module`'s, a
    `jax.tree_util.Partial`'s) are donated with the rest, as Equinox donates them.

    Calling it again replaces only what has appeared since; its `left` is a way to
    check that nothing is left. [`filterjit.unpatch_equinox`][] undoes it.

    **Returns:**

    A [`filterjit.EquinoxPatch`][]: what was replaced, where, and what was left.

    **Raises:**

    `ImportError`, saying so, if Equinox cannot be imported.

    !!! example

        ```python
        import filterjit

        filterjit.patch_equinox()  # before or after importing the libraries
        import diffrax

        type(diffrax.diffeqsolve).__name__  # "FilterJitWrapper"
        filterjit.patch_equinox().left  # (): nothing keeps Equinox's jit
        ```
    """
    try:
        equinox = importlib.import_module("equinox")
        jit_module = importlib.import_module("equinox._jit")
    except ImportError as error:
        raise ImportError(
            "filterjit.patch_equinox() puts filterjit.filter_jit in place of "
            f"equinox.filter_jit, but Equinox cannot be imported ({error}). Install "
            "it (`pip install equinox`), or use filterjit.filter_jit directly."
        ) from error
    jits = _State.original, getattr(jit_module, "filter_jit", None), equinox.filter_jit
    ours = (filter_jit, equinox_filter_jit)
    originals = [jit for jit in jits if jit is not None and jit not in ours]
    _State.original = originals[0] if originals else None
    wrapper_type = getattr(jit_module, "_JitWrapper", None)
    made: dict[int, Any] = {}  # id of Equinox's wrapper -> filterjit's, or why none
    unset: dict[int, str] = {}  # id of Equinox's wrapper -> why it could not be set
    swapped: dict[int, str] = {}
    factory_places: dict[int, list[str]] = {}
    places = []
    for owner, attribute, value in _attributes():
        wrapped = _unwrapped(value)
        if _factory(value, originals):
            factory_places.setdefault(id(value), []).append(_where(owner, attribute))
            continue
        if any(value is jit for jit in originals):
            new = equinox_filter_jit if isinstance(owner, types.ModuleType) else None
        elif type(wrapped) is wrapper_type:  # never, where wrapper_type is None
            if id(wrapped) not in made:
                made[id(wrapped)] = _replacement(wrapped, jit_module)
            new = made[id(wrapped)]
        else:
            continue
        if new is None or isinstance(new, str):
            continue
        new = new if wrapped is value else type(value)(new)
        try:
            setattr(owner, attribute, new)
        except (AttributeError, TypeError) as error:
            unset[id(wrapped)] = f"{_where(owner, attribute)} cannot be set ({error})"
            continue
        _State.swaps.append((owner, attribute, value, new))
        places.append(_where(owner, attribute))
        if new is not equinox_filter_jit:
            swapped.setdefault(id(wrapped), _name(wrapped))
    # Every live Equinox wrapper that no rewritten attribute held, with why.
    reasons = {k: v for k, v in made.items() if isinstance(v, str)} | unset
    replaced = {id(_unwrapped(old)) for _, _, old, _ in _State.swaps}
    gc.collect()  # not to report wrappers that are garbage already
    unreached = "not an attribute of a module or a class"
    left = []
    for value in gc.get_objects():
        if type(value) is wrapper_type and id(value) not in replaced:
            left.append(f"{_name(value)} ({reasons.get(id(value), unreached)})")
        elif _factory(value, originals):
            keywords = ", ".join(f"{k}={v!r}" for k, v in value.keywords.items())
            held = factory_places.get(id(value))
            where = " and ".join(held) if held else "a functools.partial"
            left.append(
                f"{where} = equinox.filter_jit({keywords}) (a decorator factory made "
                "before patch_equinox(): what it decorates keeps Equinox's jit; make "
                "it after the patch)"
            )
    left.sort()
    if left:
        warnings.warn(
            f"filterjit.patch_equinox(): {len(left)} function(s) compiled with "
            "Equinox's filter_jit, or decorator factories of it, keep it: "
            + "; ".join(left),
            # At the caller's line: `hiding_frames` wraps this function.
            stacklevel=user_frame(sys._getframe())[1],
        )
    return EquinoxPatch(tuple(swapped.values()), tuple(places), tuple(left))


@hiding_frames
def unpatch_equinox() -> None:
    """Undoes [`filterjit.patch_equinox`][]: `equinox.filter_jit` is Equinox's
    again, and every attribute the patch rewrote that still holds what it put
    there gets its Equinox wrapper back (functions decorated while the patch was in
    force keep filterjit's: no Equinox one exists for them)."""
    for owner, attribute, old, new in reversed(_State.swaps):
        if vars(owner).get(attribute) is new:
            setattr(owner, attribute, old)
    _State.swaps = []
    _State.original = None
