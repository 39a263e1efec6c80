"""Exporting a filtered function: its array leaves as a `jax.export.Exported`, and
what `filter_jit` keeps static (the arguments' and output's structures and static
leaves) as data."""

import functools as ft
import inspect
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._aot import Specialisation
from .._binding import BOUND, positional_names, Shape
from .._entry import _leaf_shardings
from .._exact import exact_aux
from .._function import call_signature, Function
from .._jax_jit import _as_tuple, JitWrapper
from .._jit import filter_jit, FilterJitWrapper
from .._options import make_options, UNSPECIFIED
from .._output import finish
from ._checks import is_traced
from ._exported import Argument, encoded, Exported, Parameters, Template
from ._program import donated_inputs, entry_point
from ._values import encode, Encoding, SIZE, StaticArgument, TRACED, Unsavable


_P = ParamSpec("_P")
_T = TypeVar("_T")


def export(
    fun: Callable[_P, _T],
    *,
    platforms: Sequence[str] | None = None,
    disabled_checks: Sequence[jax.export.DisabledSafetyCheck] = (),
) -> Callable[..., Exported[_P, _T]]:
    """Exports a function for another process, as `jax.export.export(jax.jit(fun))`
    does, with `filter_jit`'s partition of the arguments.

    `export(fun)(*args, **kwargs)` takes the arguments of `fun`: array leaves may be
    arrays or `jax.ShapeDtypeStruct`s (with symbolic shapes from
    `jax.export.symbolic_shape`), and every other leaf is static, as `filter_jit`
    partitions them. The arrays of `fun` itself (an `eqx.Module`, a bound method's
    `self`, a `functools.partial`'s arguments) and of defaults the call leaves are
    compiled into the program, with its static leaves: a saved model carries its
    weights. A symbolic size that `fun` returns as a Python value (`xs.shape[0]`)
    is returned by `call` as the call's concrete size, as `filter_jit` returns it.

    **Arguments:**

    - `fun`: the function, or a `filter_jit` wrapper of it (whose options apply:
        its donated arguments are donated by `Exported.call`, also once loaded).
    - `platforms`: the platforms to lower for (`"cpu"`, `"cuda"`, `"rocm"`,
        `"tpu"`), as in `jax.export.export`; the default backend's if omitted.
    - `disabled_checks`: as in `jax.export.export`: a
        `jax.export.DisabledSafetyCheck.custom_call(name)` lets the program call a
        custom call of your own (an FFI kernel) that JAX does not guarantee stable.
        `filterjit.deserialize` refuses any other.

    **Returns:**

    A function of the arguments of `fun` that returns a `filterjit.Exported`.

    !!! example

        ```python
        batch = jax.export.symbolic_shape("b")[0]
        x = jax.ShapeDtypeStruct((batch, 3), jnp.float32)
        exported = filterjit.export(model)(x)
        data = exported.serialize()  # filterjit.deserialize(data).call(x) elsewhere
        ```
    """
    static: tuple[str, ...] = ()
    if isinstance(fun, JitWrapper):
        wrapper, static = _as_filter_jit(fun)
    else:
        wrapper = fun if isinstance(fun, FilterJitWrapper) else filter_jit(fun)
    # Untyped: arrays may be given as `jax.ShapeDtypeStruct`s.
    return ft.partial(_export, wrapper, platforms, tuple(disabled_checks), static)


def _as_filter_jit(
    wrapper: JitWrapper[..., Any],
) -> tuple[FilterJitWrapper[..., Any], tuple[str, ...]]:
    """A `filterjit.jit` wrapper as `filter_jit` with its keywords (donation and
    shardings kept), exported as `jax.export.export` would export it; and the
    parameters it makes static (`static_argnums`, `static_argnames`), whose values
    the export holds as they are, arrays included, boxed in a `StaticArgument`."""
    keywords = dict(wrapper._jit_kwargs)
    function = Function(wrapper._function)
    positional = positional_names(function.parameters)

    def named(option: str) -> list[str]:
        """The parameters an `*_argnums` or `*_argnames` option names."""
        found = list(_as_tuple(keywords.pop(f"{option}_argnames", ())))
        for number in _as_tuple(keywords.pop(f"{option}_argnums", ())):
            if not -len(positional) <= number < len(positional):
                raise TypeError(
                    f"filterjit.export: {function.name} has {option}_argnums="
                    f"{number}, which is not a parameter of its own (an argument "
                    "that `*args` collects). Export a function that names it, or use "
                    f"`filterjit.filter_jit(f, donate=...)`."
                )
            found.append(positional[number])
        return found

    static = named("static")
    donated = named("donate")
    if isinstance(keywords.get("in_shardings"), tuple | list):
        # jax.jit's are the non-static arguments'; filter_jit's, every positional's
        # (those `*args` collects after the named ones).
        given = iter(keywords["in_shardings"])
        keywords["in_shardings"] = (
            *(None if name in static else next(given, None) for name in positional),
            *given,
        )
    options = make_options(donate=tuple(donated) or "none", **keywords)
    fun = wrapper._function
    if static:
        fun = _unboxing(fun)
    return FilterJitWrapper(fun, options), tuple(static)


def _unboxing(fun: Callable[..., Any]) -> Callable[..., Any]:
    """`fun`, called with its static arguments unboxed; its signature and names
    are `fun`'s."""

    @ft.wraps(fun)
    def unboxed(*args: Any, **kwargs: Any) -> Any:
        args = tuple(a.value if type(a) is StaticArgument else a for a in args)
        kwargs = {
            k: v.value if type(v) is StaticArgument else v for k, v in kwargs.items()
        }
        return fun(*args, **kwargs)

    unboxed.__signature__ = call_signature(fun)  # pyright: ignore[reportAttributeAccessIssue]
    del unboxed.__wrapped__  # its calls pass boxes: nothing may call `fun` for it
    return unboxed


def _boxed(
    function: Function, static: tuple[str, ...], args: Any, kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of a call, those of the parameters `static` boxed."""
    positional = positional_names(function.parameters)
    args = tuple(
        StaticArgument(a) if i < len(positional) and positional[i] in static else a
        for i, a in enumerate(args)
    )
    kwargs = {k: StaticArgument(v) if k in static else v for k, v in kwargs.items()}
    return args, kwargs


def _defaults(fun: Any) -> dict[int | str, Any]:
    """The saved data of each default of `fun`'s signature that a payload holds,
    by the key its argument is bound at (a position, or a keyword-only name)."""
    signature = call_signature(fun)
    found: dict[int | str, Any] = {}
    positional = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )
    parameters = [] if signature is None else signature.parameters.values()
    keys = [
        position if p.kind in positional else p.name
        for position, p in enumerate(parameters)
    ]
    for key, parameter in zip(keys, parameters):
        if parameter.kind in (*positional, inspect.Parameter.KEYWORD_ONLY):
            if parameter.default is not inspect.Parameter.empty and (
                parameter.default is not BOUND
            ):
                try:
                    found[key] = encode(parameter.default, "", Encoding())
                except Unsavable:
                    pass  # an array, or what a payload cannot hold: compiled in
    return found


def _arguments(
    function: Function, fun: Any, called: Specialisation, shape: Shape
) -> tuple[list[Argument], list[int], list[tuple[str, Any]]]:
    """The exporting call's (of `shape`) bound arguments with their saved data; the
    positions of the traced leaves it passed (the program's inputs); its opaques."""
    partition, leaves = called.partition, called.leaves
    traced = set(partition.dynamic_positions)
    template = [TRACED if p in traced else leaf for p, leaf in enumerate(leaves)]
    _, args, kwargs = function.split_call(fun, partition.treedef.unflatten(template))
    positional, keywords = function.bind.sources(shape) or function.bind.find_sources(
        shape[0], shape[1:]
    )
    sources = {**dict(enumerate(positional)), **keywords}
    given = {key for key, (source, _) in sources.items() if source != "default"}
    opaque: list[tuple[str, Any]] = []
    encoding, arguments = Encoding(opaque), []
    defaults = _defaults(fun)
    for key, prototype in [*enumerate(args), *sorted(kwargs.items())]:
        label, first = function.label(key), len(opaque)
        data = encoded(prototype, label, function.name, encoding)
        paths, treedef = jtu.tree_flatten_with_path(prototype)
        labels = [label + jtu.keystr(p) for p, leaf in paths if leaf is TRACED]
        argument = Argument(
            key, key in given, data, labels, treedef=treedef, exact=exact_aux(treedef)
        )
        # The classes the arguments name, filled as they are encoded.
        argument.classes = encoding.names
        argument.opaque = first if len(opaque) > first else None
        argument.default = key in given and key in defaults and defaults[key] == data
        argument.static = type(prototype) is StaticArgument
        arguments.append(argument)
    inputs = []
    for position, parameter in enumerate(function.leaf_parameters(partition.treedef)):
        key = parameter.parameter if parameter.position is None else parameter.position
        if position in traced and key in given:
            inputs.append(position)
        elif position in traced and isinstance(leaves[position], jax.ShapeDtypeStruct):
            raise TypeError(
                f"{function.name}: `{parameter.label}` is a jax.ShapeDtypeStruct, "
                "but arrays of the function itself and of defaults are compiled "
                "into the export: give it a value."
            )
    return arguments, inputs, opaque


def _export(
    wrapper: FilterJitWrapper[..., Any],
    platforms: Sequence[str] | None,
    disabled_checks: Sequence[jax.export.DisabledSafetyCheck],
    static: tuple[str, ...],
    /,
    *args: Any,
    **kwargs: Any,
) -> Exported[..., Any]:
    dispatcher, fun = wrapper._dispatcher, wrapper._fun
    if static:
        args, kwargs = _boxed(dispatcher.function, static, args, kwargs)
    # The very partition and jitted function of a top-level call with these arrays.
    called = Specialisation(dispatcher, fun, *args, **kwargs)
    function = dispatcher.function  # as the call read it
    arguments, inputs, opaque = _arguments(function, fun, called, (len(args), *kwargs))
    leaves = called.leaves
    found: list[Template] = []  # what the one trace below learns of the output

    def program(*traced_inputs: Any) -> list[Any]:
        given = dict(zip(inputs, traced_inputs, strict=True))
        # The other traced leaves (the function's own, defaults') are compiled in.
        dynamic = [given.get(p, leaves[p]) for p in called.partition.dynamic_positions]
        output = finish(called.jitted(*dynamic), leaves)
        out_leaves, treedef = jtu.tree_flatten(output)
        symbolic = lambda x: not isinstance(x, int) and jax.export.is_symbolic_dim(x)  # noqa: E731
        template = [
            TRACED if is_traced(x) else SIZE if symbolic(x) else x for x in out_leaves
        ]
        found.append(Template(treedef.unflatten(template), "output"))
        # A symbolic size: an empty array whose last axis has that size.
        return [
            jnp.asarray(x) if kind is TRACED else jnp.zeros((0, x), jnp.int8)
            for x, kind in zip(out_leaves, template)
            if kind is TRACED or kind is SIZE
        ]

    program.__name__ = function.name.rpartition(".")[2]
    program.__qualname__ = function.name
    specs = [leaves[p] for p in inputs]
    donated: list[int] = []
    if dispatcher.options.donate != "none":  # the inputs donated, as JAX lowers it
        lowered = called.jitted.lower(*called.dynamic)
        flags = [info.donated for info in jtu.tree_leaves(lowered.args_info)]
        positions = called.partition.dynamic_positions
        by_leaf = {positions[i] for i, flag in enumerate(flags) if flag}
        donated = [i for i, position in enumerate(inputs) if position in by_leaf]
    # The program's entry point records the shardings of the inputs it takes, as
    # `jax.export.export` of a `jax.jit` with these `in_shardings` does.
    keywords: dict[str, Any] = {"donate_argnums": tuple(donated)}
    if dispatcher.options.in_shardings is not UNSPECIFIED:
        per_leaf = _leaf_shardings(
            function, dispatcher.options.in_shardings, called.partition, leaves
        )
        by_position = dict(zip(called.partition.dynamic_positions, per_leaf))
        keywords["in_shardings"] = tuple(by_position[p] for p in inputs)
    try:
        exported = jax.export.export(
            jax.jit(program, **keywords),
            platforms=platforms,
            disabled_checks=disabled_checks,
        )(*specs)
    except NotImplementedError as error:
        if "host_callbacks" not in str(error):
            raise
        raise TypeError(_host_callbacks(function.name, program, specs)) from error
    (output,) = found
    _refuse_symbolic_statics(output, function.name)
    # What the program donates, as the loader reads it: an input JAX found no use
    # for is not donated.
    entry = entry_point(exported.mlir_module())
    donated = donated_inputs(exported, entry)
    return Exported(
        exported,
        function.name,
        Parameters.of(function, fun),
        arguments,
        output,
        donated,
        opaque,
    )


def _refuse_symbolic_statics(output: Template, fun_name: str) -> None:
    """Raises where the output holds a symbolic size in a static part (a Module's
    static field, a dict's key), which no call could give a value."""
    statics: list[tuple[str, Any]] = []
    try:
        encode(output.prototype, output.label, Encoding(statics))
    except Unsavable:
        pass  # what `serialize()` names
    for where, value in statics:
        if not isinstance(value, int) and jax.export.is_symbolic_dim(value):
            raise TypeError(
                f"{fun_name}: `{where}` is the symbolic size `{value}` in a static "
                "part of the output (a static field, a dict's key), which the "
                "export cannot give the size of a call. Return it where it is a "
                "leaf (`xs.shape[0]` in a tuple, or a field that is not static), "
                "or export with a concrete size."
            )


def _host_callbacks(
    fun_name: str, program: Callable[..., Any], specs: list[Any]
) -> str:
    """Why a program with host callbacks cannot be exported, naming them (traced
    again: this is the error's path alone)."""
    found: list[str] = []

    def walk(jaxpr: Any) -> None:
        for equation in jaxpr.eqns:
            if "callback" in equation.primitive.name:
                found.append(_callback_name(equation))
            for parameter in equation.params.values():
                inner = (
                    parameter if isinstance(parameter, tuple | list) else [parameter]
                )
                for item in inner:
                    item = getattr(item, "jaxpr", item)  # a closed jaxpr's own
                    if hasattr(item, "eqns"):
                        walk(item)

    walk(jax.make_jaxpr(program)(*specs).jaxpr)
    named = ", ".join(dict.fromkeys(found)) or "a host callback"
    return (
        f"{fun_name}: cannot export a program that calls back into Python: "
        f"{named}. A payload holds no Python, and a callback names a function of "
        "this process. Export without it: for an Equinox runtime check, set the "
        "environment variable `EQX_ON_ERROR=nan` before Equinox is imported (a "
        "failed check then gives NaNs, not an error), or leave the check out "
        "(diffrax: `diffeqsolve(..., throw=False)`, and read the solution's "
        "`result`); leave out `jax.debug.print` and `jax.debug.callback`."
    )


_LIBRARIES = ("/jax/", "/jaxlib/", "/equinox/", "/filterjit/")


def _callback_name(equation: Any) -> str:
    """A host callback as the export error names it: the runtime check it is, and
    where the user's code made it (where its traceback says)."""
    traceback = equation.source_info.traceback
    frames = [] if traceback is None else traceback.frames
    files = [frame.file_name.replace("\\", "/") for frame in frames]
    user = next(
        (f for f, name in zip(frames, files) if not any(p in name for p in _LIBRARIES)),
        None,
    )
    where = "" if user is None else f" at {user.file_name}:{user.line_num}"
    if any(name.endswith("equinox/_errors.py") for name in files):
        return (
            "an Equinox runtime check (`eqx.error_if`, `eqx.branched_error_if`; "
            f"diffrax's `throw=True` makes one){where}"
        )
    return f"`{equation.primitive.name}`{where}"
