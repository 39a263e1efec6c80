"""Exporting a filtered function: its array leaves as a `jax.export.Exported`, and
what `filter_jit` keeps static (the arguments' structure and static leaves, the
output's structure and static leaves) as data that loads without importing or
unpickling anything it names."""

import inspect
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._aot import Specialisation
from .._exact import exact_aux
from .._function import Function
from .._jax_jit import JitWrapper
from .._jit import filter_jit, FilterJitWrapper
from .._options import make_options
from .._output import finish
from ._checks import is_traced
from ._exported import encoded, Exported, Template
from ._signature import Argument, DEFAULT, Parameters
from ._values import Encoding, SIZE, TRACED


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
    if isinstance(fun, JitWrapper):
        wrapper = _as_filter_jit(fun)
    elif isinstance(fun, FilterJitWrapper):
        wrapper = fun
    else:
        wrapper = filter_jit(fun)
    checks = tuple(disabled_checks)

    # Untyped: arrays may be given as `jax.ShapeDtypeStruct`s.
    def exporting(*args: Any, **kwargs: Any) -> Exported[_P, _T]:
        return _export(wrapper, platforms, checks, args, kwargs)

    return exporting


def _as_filter_jit(wrapper: JitWrapper[..., Any]) -> FilterJitWrapper[..., Any]:
    """A `filterjit.jit` wrapper as `filter_jit` with its keywords, so that its
    export is the program `jax.export.export` makes of it: its donated arguments
    donated, its shardings kept, its other keywords passed on. Its static arguments
    are static as every leaf that is not an array is."""
    keywords = dict(wrapper._jit_kwargs)
    name = getattr(wrapper, "__qualname__", repr(wrapper))
    parameters = list(inspect.signature(wrapper).parameters.values())
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p.name for p in parameters if p.kind in kinds]

    def named(option: str) -> list[str]:
        """The parameters an `*_argnums` or `*_argnames` option names."""
        found = list(_as_tuple(keywords.pop(f"{option}_argnames", ())))
        for number in _as_tuple(keywords.pop(f"{option}_argnums", ())):
            if not -len(positional) <= number < len(positional):
                raise TypeError(
                    f"filterjit.export: {name} has {option}_argnums={number}, which "
                    "is not a parameter of its own (an argument that `*args` "
                    f"collects). Export a function that names it, or use "
                    f"`filterjit.filter_jit(f, donate=...)`."
                )
            found.append(positional[number])
        return found

    static = named("static")
    donated = named("donate")
    if isinstance(keywords.get("in_shardings"), tuple | list):
        # jax.jit's are the non-static arguments'; filter_jit's, every positional's.
        given = iter(keywords["in_shardings"])
        keywords["in_shardings"] = tuple(
            None if parameter in static else next(given, None)
            for parameter in positional
        )
    options = make_options(donate=tuple(donated) or "none", **keywords)
    return FilterJitWrapper(wrapper._function, options)


def _as_tuple(value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int | str) else tuple(value)


def _leaf_count(tree: Any) -> int:
    return jtu.tree_structure(tree).num_leaves


def _bound_arguments(
    fun: Any,
    function: Function,
    parameters: Parameters,
    called: Specialisation,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    encoding: Encoding,
) -> tuple[list[Argument], list[int]]:
    """Each bound argument of the exporting call with its saved data, and the
    positions (among the bound call's leaves) of the traced leaves of the arguments
    it passed: the program's inputs."""
    given = parameters.bind(args, kwargs)
    bound_args, bound_kwargs = function.bind(args, kwargs)
    values = [*bound_args, *(bound_kwargs[key] for key in sorted(bound_kwargs))]
    leaves, traced = called.leaves, set(called.partition.dynamic_positions)
    # The bound call's leaves: the function's own, then each argument's in turn.
    start = 0 if function.fun_is_leaf else _leaf_count(fun)
    arguments: list[Argument] = []
    inputs: list[int] = []
    for (key, passed), value in zip(given, values, strict=True):
        span = range(start, start + _leaf_count(value))
        template_leaves = [TRACED if p in traced else leaves[p] for p in span]
        treedef, label = jtu.tree_structure(value), parameters.name(key)
        prototype = treedef.unflatten(template_leaves)
        data = encoded(prototype, label, function.name, encoding)
        paths = jtu.tree_flatten_with_path(prototype)[0]
        labels = [label + jtu.keystr(p) for p, leaf in paths if leaf is TRACED]
        argument = Argument(key, passed is not DEFAULT, data, labels)
        argument.treedef, argument.exact = treedef, exact_aux(treedef)
        arguments.append(argument)
        if passed is not DEFAULT:
            inputs += [p for p in span if p in traced]
        start = span.stop
    if start != len(leaves):
        raise AssertionError(
            f"{function.name}: the bound call has {len(leaves)} leaves"
        )
    return arguments, inputs


def _compiled_in(
    function: Function, called: Specialisation, inputs: list[int]
) -> dict[int, Any]:
    """The traced leaves that are not the program's inputs (the function's own, and
    defaults'), by position: compiled into the program."""
    treedef, leaves = called.partition.treedef, called.leaves
    labels = [p.label for p in function.leaf_parameters(treedef)]
    taken = set(inputs)
    found = {}
    for position in called.partition.dynamic_positions:
        if position in taken:
            continue
        if isinstance(leaves[position], jax.ShapeDtypeStruct):
            raise TypeError(
                f"{function.name}: `{labels[position]}` is a jax.ShapeDtypeStruct, "
                "but arrays of the function itself and of defaults are compiled "
                "into the export: give it a value."
            )
        found[position] = leaves[position]
    return found


def _donated_inputs(called: Specialisation, inputs: list[int]) -> list[int]:
    """Which of the program's inputs the wrapper donates, as JAX lowers its call."""
    lowered = called.jitted.lower(*called.dynamic)
    flags = [info.donated for info in jtu.tree_leaves(lowered.args_info)]
    positions = called.partition.dynamic_positions
    donated = {positions[i] for i, flag in enumerate(flags) if flag}
    return [i for i, position in enumerate(inputs) if position in donated]


def _output_leaf(leaf: Any) -> Any:
    """What the program returns for an output leaf: an array for a traced one, and
    for a symbolic size an empty array whose last axis has that size."""
    if is_traced(leaf):
        return jnp.asarray(leaf)
    return jnp.zeros((0, leaf), jnp.int8)


def _is_symbolic(leaf: Any) -> bool:
    return not isinstance(leaf, int) and jax.export.is_symbolic_dim(leaf)


def _export(
    wrapper: FilterJitWrapper[..., Any],
    platforms: Sequence[str] | None,
    disabled_checks: Sequence[jax.export.DisabledSafetyCheck],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Exported[..., Any]:
    dispatcher, fun = wrapper._dispatcher, wrapper._fun
    function = dispatcher.function
    # The very partition and jitted function of a top-level call with these arrays.
    called = Specialisation(dispatcher, fun, *args, **kwargs)
    parameters = Parameters.of(function.name, fun)
    encoding = Encoding(opaque=[])
    arguments, inputs = _bound_arguments(
        fun, function, parameters, called, args, kwargs, encoding
    )
    compiled_in = _compiled_in(function, called, inputs)
    positions, leaves, jitted = (
        called.partition.dynamic_positions,
        called.leaves,
        called.jitted,
    )
    found: list[Template] = []  # what the one trace below learns of the output

    def program(*traced_inputs: Any) -> list[Any]:
        given_leaves = iter(traced_inputs)
        dynamic = [
            compiled_in[p] if p in compiled_in else next(given_leaves)
            for p in positions
        ]
        output = finish(jitted(*dynamic), leaves)
        out_leaves, treedef = jtu.tree_flatten(output)
        template = [
            TRACED if is_traced(x) else SIZE if _is_symbolic(x) else x
            for x in out_leaves
        ]
        found.append(Template(treedef, template, "output"))
        return [
            _output_leaf(x)
            for x, kind in zip(out_leaves, template)
            if kind is TRACED or kind is SIZE
        ]

    program.__name__ = function.name.rpartition(".")[2]
    program.__qualname__ = function.name
    specs = [leaves[p] for p in inputs]
    donated = [] if dispatcher.options.donate == "none" else None
    if donated is None:
        donated = _donated_inputs(called, inputs)
    exported = jax.export.export(
        jax.jit(program, donate_argnums=tuple(donated)),
        platforms=platforms,
        disabled_checks=disabled_checks,
    )(*specs)
    (output,) = found
    for argument in arguments:
        argument.classes = encoding.names
    return Exported(
        exported,
        function.name,
        parameters,
        arguments,
        output,
        donated,
        encoding.opaque or (),
    )
