"""Ahead-of-time compilation: `wrapped.trace(...)`, `.lower(...)`, `.compile()`."""

import functools as ft
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core

from ._dispatch import Dispatcher
from ._entry import ForCall
from ._output import finish
from ._tracebacks import hiding_frames


class Specialisation:
    """The call an ahead-of-time object was made for, to check other calls against."""

    def __init__(self, dispatcher: Dispatcher, fun: Any, /, *args: Any, **kwargs: Any):
        self._abstract = ft.partial(dispatcher.abstract, fun)
        self._function = dispatcher.function
        self.name = dispatcher.function.name
        entry, self.partition, self.dynamic, self.leaves = self._abstract(args, kwargs)
        # Its traces see this call's leaves, as every trace sees its own call's.
        self.jitted = ForCall(entry, self.leaves)
        self.statics = list(self.partition.statics(self.leaves))
        self._donates = dispatcher.options.donate != "none"
        self._defaulted = self._left_to_defaults(args, kwargs)

    def _left_to_defaults(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[str, ...]:
        """Where donation applies, the parameters holding arrays a call leaves to
        defaults (never donated): a call that leaves others would donate them."""
        if not self._donates:
            return ()
        return self._function.defaulted((len(args), *kwargs))

    def check(self, /, *args: Any, **kwargs: Any) -> tuple[Sequence[Any], list[Any]]:
        """A call's traced leaves and leaves; raises if it differs in anything but its
        traced leaves' values."""
        _, partition, dynamic, leaves = self._abstract(args, kwargs)
        lowered, function, name = self.partition, self._function, self._function.name
        if partition.treedef != lowered.treedef or partition.exact != lowered.exact:
            raise TypeError(
                f"{name}: called with arguments whose structure differs from the one "
                f"it was lowered with.\n  lowered with: {lowered.treedef}\n  called "
                f"with:  {partition.treedef}\nLower again for the new structure."
            )
        defaulted = self._left_to_defaults(args, kwargs)
        if defaulted != self._defaulted:
            raise TypeError(
                f"{name}: compiled to donate the arguments passed when lowered, and "
                f"this call leaves other array parameters to their defaults ("
                f"{', '.join(defaulted) or 'none'}, where the lowered call left "
                f"{', '.join(self._defaulted) or 'none'}), which would be donated. "
                "Pass the same arguments as when lowering, or lower again."
            )
        labels = [p.label for p in function.leaf_parameters(partition.treedef)]
        traced = set(lowered.dynamic_positions)
        for position in set(partition.dynamic_positions) ^ traced:
            was = "traced" if position in traced else "static"
            now = "static" if position in traced else "traced"
            raise TypeError(
                f"{name}: argument `{labels[position]}` was {was} when lowered "
                f"and is {now} now (it is a `{type(leaves[position]).__name__}`). "
                "Pass the same kind of value, or lower again."
            )
        for position in partition.dynamic_positions:
            if isinstance(leaves[position], jax.ShapeDtypeStruct):
                raise TypeError(
                    f"{name}: argument `{labels[position]}` is a "
                    "`jax.ShapeDtypeStruct`. When lowering, a ShapeDtypeStruct "
                    "stands for an array of its shape and dtype, and was traced as "
                    "one; the compiled function takes that array. Pass an array "
                    f"of shape {leaves[position].shape} and dtype "
                    f"{leaves[position].dtype}. For a static setting, pass a value "
                    "of another type (a tuple of the shape and dtype) when lowering "
                    "and calling, or name it static with `filterjit.jit(f, "
                    f"static_argnames={labels[position]!r})`."
                )
        statics = list(partition.statics(leaves))
        if partition.signature[2] == lowered.signature[2] and statics == self.statics:
            return dynamic, leaves
        for index, position in enumerate(partition.static_positions):
            before, now = self.leaves[position], leaves[position]
            if type(before) is not type(now) or self.statics[index] != statics[index]:
                raise ValueError(
                    f"{name}: static argument `{labels[position]}` was "
                    f"{before!r} when lowered and is {now!r} now. Static values "
                    "are compiled in: lower again with the new value, or make it "
                    "an array so that it is traced."
                )
        return dynamic, leaves


class Compiled:
    """A `filter_jit` function compiled ahead of time. Call it like the wrapped
    function; it checks that the static arguments are those it was lowered with.

    **Raises** (when called):

    - `TypeError`: the arguments' structure differs from the one it was lowered
        with, a leaf that was traced is static now or the reverse, or an array's
        shape or dtype differs (JAX's message).
    - `ValueError`: a static argument differs from the value it was lowered with.
    """

    def __init__(self, compiled: jax.stages.Compiled, specialisation: Specialisation):
        self.compiled = compiled
        """The underlying `jax.stages.Compiled`."""
        self._specialisation = specialisation

    @hiding_frames
    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        dynamic, leaves = self._specialisation.check(*args, **kwargs)
        return finish(self.compiled(*dynamic), leaves)

    def as_text(self) -> str | None:
        """The compiled program's text, as `jax.stages.Compiled.as_text`."""
        return self.compiled.as_text()

    def cost_analysis(self) -> Any:
        """XLA's cost estimates, as `jax.stages.Compiled.cost_analysis`."""
        return self.compiled.cost_analysis()

    def memory_analysis(self) -> Any:
        """XLA's memory estimates, as `jax.stages.Compiled.memory_analysis`."""
        return self.compiled.memory_analysis()


class Lowered:
    """A `filter_jit` function lowered ahead of time."""

    def __init__(self, lowered: jax.stages.Lowered, specialisation: Specialisation):
        self.lowered = lowered
        """The underlying `jax.stages.Lowered`."""
        self._specialisation = specialisation

    def as_text(self, dialect: str | None = None, *, debug_info: bool = False) -> str:
        """The lowered program's text, as `jax.stages.Lowered.as_text`."""
        return self.lowered.as_text(dialect, debug_info=debug_info)

    def compiler_ir(self, dialect: str | None = None) -> Any:
        """The program as an MLIR module, as `jax.stages.Lowered.compiler_ir`."""
        return self.lowered.compiler_ir(dialect)

    @hiding_frames
    def compile(
        self,
        compiler_options: dict[str, Any] | None = None,
        *,
        device_assignment: tuple[Any, ...] | None = None,
    ) -> Compiled:
        """Compiles the program, as `jax.stages.Lowered.compile`. The result is
        called like the wrapped function."""
        compiled = self.lowered.compile(
            compiler_options, device_assignment=device_assignment
        )
        return Compiled(compiled, self._specialisation)


class Traced:
    """A `filter_jit` function traced ahead of time, as `jax.stages.Traced`."""

    def __init__(self, traced: jax.stages.Traced, specialisation: Specialisation):
        self.traced = traced
        """The underlying `jax.stages.Traced`."""
        self._specialisation = specialisation

    @property
    def jaxpr(self) -> jax.extend.core.ClosedJaxpr:
        """The program, as a `ClosedJaxpr` whose inputs are the traced leaves."""
        return self.traced.jaxpr

    @property
    def out_info(self) -> Any:
        """The output, with `jax.ShapeDtypeStruct`s for traced leaves and every
        other leaf as the function returned it."""
        return finish(self.traced.out_info, self._specialisation.leaves)

    @property
    def fun_name(self) -> str:
        """The traced function's name."""
        return self._specialisation.name

    @hiding_frames
    def lower(
        self,
        *,
        lowering_platforms: tuple[str, ...] | None = None,
        _private_parameters: Any = None,
    ) -> Lowered:
        """Lowers the traced program, as `jax.stages.Traced.lower`; see `Lowered`.

        **Arguments:**

        - `lowering_platforms`: the platforms to lower for (`("cpu", "cuda")`, say),
            as in JAX; the default backend's if omitted.
        """
        if _private_parameters is not None:
            # Only `jax.export.export` passes these: its `Exported` would take the
            # traced leaves alone and return filterjit's own output node.
            raise TypeError(
                f"jax.export.export cannot export the filter_jit function "
                f"{self._specialisation.name}: its static arguments and static "
                "outputs are not arrays, which a jax.export.Exported holds alone. "
                "Use `filterjit.export(f)(*args)`: its result's `.exported` is the "
                "jax.export.Exported of the array leaves."
            )
        platforms = None if lowering_platforms is None else tuple(lowering_platforms)
        return Lowered(
            self.traced.lower(lowering_platforms=platforms), self._specialisation
        )
