"""`filter_jit`'s options, validated once."""

import dataclasses
import inspect
from typing import Any, get_args, Literal

import jax

from ._function import Function


_DonateString = Literal["none", "all", "all-except-first", "warn", "warn-except-first"]
DonateOption = _DonateString | tuple[str, ...]
"""Which argument buffers `filter_jit` donates at the top level: `"none"`, `"all"`,
`"all-except-first"` (these two silence JAX's warning about donations it cannot
use), `"warn"`, `"warn-except-first"` (the same, warning), or a tuple of parameter
names such as `("state",)`."""

_DONATE_STRINGS = get_args(_DonateString)

_STATIC_ADVICE = (
    "filter_jit makes every non-array leaf static already; pass the value as a "
    "Python object, or wrap it in an array to trace it"
)
# jax.jit options that filter_jit replaces, and what to use instead.
_REJECTED_JIT_KWARGS = {
    "static_argnums": _STATIC_ADVICE,
    "static_argnames": _STATIC_ADVICE,
    "donate_argnums": "use filter_jit(..., donate='all'), 'all-except-first', or a "
    "tuple of parameter names such as donate=('state',)",
    "donate_argnames": "use filter_jit(..., donate=('name', ...)) with the "
    "parameter names",
}
# Keywords of Equinox's `filter_jit` before its version 0.10.0, removed there.
_REMOVED_EQUINOX_KEYWORDS = ("default", "fn", "args", "kwargs", "out")
_EQUINOX_0_10 = "https://github.com/patrick-kidger/equinox/releases/tag/v0.10.0"


class _Unspecified:
    """An option not given. One object, kept one through copies and pickles."""

    def __repr__(self) -> str:
        return "UNSPECIFIED"

    __reduce__ = __repr__  # pickled as this module's `UNSPECIFIED`


UNSPECIFIED: Any = _Unspecified()
_JIT_PARAMETERS = frozenset(inspect.signature(jax.jit).parameters) - {"fun"}


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of one `filter_jit` wrapper."""

    donate: DonateOption = "none"
    inline: Any = False  # a bool, or (jax >= 0.11) a member of `jax.Inline`
    # In the user's terms (prefixes of the arguments and output), not jax.jit's.
    in_shardings: Any = UNSPECIFIED
    out_shardings: Any = UNSPECIFIED
    jitkwargs: tuple[tuple[str, Any], ...] = ()  # every other jax.jit keyword
    # What `donate` counts as arguments. By default a method's receiver (or a
    # callable Module) is the first argument, and what a partial binds is none.
    # Else the function's own traced leaves are no argument ("first" is the call's
    # first), and `donate_function` says whether a string option donates them.
    receiver_is_argument: bool = True
    donate_function: bool = False

    @property
    def same_at_every_level(self) -> bool:
        """Whether the options mean the same at every level (none applies at the
        top level alone), so that a nested call may be the program a top-level
        call is."""
        return (
            self.donate == "none"
            and self.inline is False
            and self.in_shardings is UNSPECIFIED
            and self.out_shardings is UNSPECIFIED
            and "compiler_options" not in dict(self.jitkwargs)
        )


def make_options(**options: Any) -> Options:
    """`Options` from `filter_jit`'s keywords, each checked, saying what to do."""
    donate = options.pop("donate", "none")
    inline = options.pop("inline", False)
    in_shardings = options.pop("in_shardings", UNSPECIFIED)
    out_shardings = options.pop("out_shardings", UNSPECIFIED)
    if not isinstance(donate, tuple) and donate not in _DONATE_STRINGS:
        raise ValueError(
            f"filter_jit: donate={donate!r} is not an option. Use one of "
            f"{', '.join(repr(s) for s in _DONATE_STRINGS)}, or a tuple of "
            "parameter names such as donate=('state',)."
        )
    for name in options:
        if name in _REMOVED_EQUINOX_KEYWORDS:
            raise ValueError(
                f"filter_jit does not take `{name}=`: Equinox's filter_jit removed "
                f"it in version 0.10.0, whose release notes ({_EQUINOX_0_10}) say "
                "how to upgrade. Arrays anywhere in the arguments are traced and "
                "everything else is static, with no filter to give."
            )
        if name in _REJECTED_JIT_KWARGS:
            raise ValueError(
                f"filter_jit does not take `{name}`: {_REJECTED_JIT_KWARGS[name]}. "
                f"Or keep jax.jit's keywords with `filterjit.jit(fun, {name}=...)`, "
                "which is jax.jit at the top level and a no-op when nested."
            )
        if name not in _JIT_PARAMETERS:
            raise TypeError(f"filter_jit() got an unexpected keyword argument {name!r}")
    for name in donate if isinstance(donate, tuple) else ():
        if not isinstance(name, str):
            raise ValueError(
                f"filter_jit: donate={donate!r} holds {name!r}, which is not a "
                "parameter name. Give parameter names as strings, such as "
                "donate=('state',)."
            )
    inline_modes: Any = getattr(jax, "Inline", bool)  # jax >= 0.11
    if not isinstance(inline, bool | inline_modes):
        modes = "" if inline_modes is bool else ", or a member of jax.Inline"
        raise ValueError(
            f"inline={inline!r} is not an option. Use inline=True or inline=False"
            f"{modes}."
        )
    if isinstance(in_shardings, list):
        in_shardings = tuple(in_shardings)
    return Options(donate, inline, in_shardings, out_shardings, tuple(options.items()))


def check_donated_names(function: Function, names: tuple[str, ...]) -> None:
    """Raises for a name in `donate=(names...)` that no call of the function
    `function` records can donate. As in `jax.jit`'s `donate_argnames`, a name is a
    parameter's, a keyword a `**kwargs` collects, or a method's receiver; not the
    `**kwargs` parameter's own name."""
    parameters = function.parameters
    known = {p.name for p in parameters if p.kind is not p.VAR_KEYWORD}
    var_keyword = [p.name for p in parameters if p.kind is p.VAR_KEYWORD]
    if function.receiver is not None:
        known.add(function.receiver)
    for name in names:
        if name in var_keyword:
            raise ValueError(
                f"filter_jit: donate={names!r} names {name!r}, the `**{name}` "
                f"parameter of {function.name!r}. Name the keyword arguments to "
                f"donate instead (for `f(x, state=s)`, donate=('state',)), as "
                "jax.jit's donate_argnames does."
            )
        if name not in known and not var_keyword:
            raise ValueError(
                f"filter_jit: donate={names!r} names {name!r}, which is not a "
                f"parameter of {function.name!r} (parameters: {sorted(known)}), so "
                "no call can donate it."
            )
