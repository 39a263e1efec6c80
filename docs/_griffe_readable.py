"""A griffe extension for the API pages (mkdocs.yml): signatures as a user reads
them, without the type variables that type checkers need.

- `Callable[_P, _R]` reads `Callable[..., Any]`; a wrapper type's parameters
  (`FilterJitWrapper[_P, _R]`) are dropped; a lone `_R` or `_T` reads `Any`;
  `type[_T]` reads `type`.
- `*args: _P.args, **kwargs: _P.kwargs` read `*args, **kwargs` (the docstring says
  what they are: the wrapped function's arguments).
- An overloaded function shown as its implementation gets, for each parameter
  annotated `Any` there, the union of what its overloads accept.
- The private alias `DonateOption` is spelled out.
- A parameter with a private name and a default (`_private_parameters=None`,
  which JAX passes) is not shown.
- An attribute set from a parameter of the same name (`self.x = x`) shows no
  value, and the parameter's type.
"""

import re
from typing import Any

import griffe


_REWRITES = [
    (re.compile(r"\bDonateOption\b"), "str | tuple[str, ...]"),
    (re.compile(r"\b_[PQ]\.(args|kwargs)\b"), "Any"),
    (re.compile(r"\bCallable\[_[PQ], (\w+)\]"), r"Callable[..., \1]"),
    (re.compile(r"\b(\w+)\[(?:_[PQ]|\.\.\.), (?:_[RST]|Any)\]"), r"\1"),
    (re.compile(r"\btype\[_[RST]\]"), "type"),
    (re.compile(r"\b_[RST]\b"), "Any"),
]


def readable(annotation: Any) -> str | None:
    if annotation is None:
        return None
    text = str(annotation)
    for pattern, replacement in _REWRITES:
        text = pattern.sub(replacement, text)
    return text


def _rewrite(function: griffe.Function) -> None:
    for parameter in list(function.parameters):
        if parameter.name.startswith("_") and parameter.default is not None:
            del function.parameters[parameter.name]  # for JAX's use, not a user's
            continue
        if parameter.kind in (
            griffe.ParameterKind.var_positional,
            griffe.ParameterKind.var_keyword,
        ) and re.search(r"\b_[PQ]\.", str(parameter.annotation)):
            parameter.annotation = None
        else:
            parameter.annotation = readable(parameter.annotation)
    function.returns = readable(function.returns)


def _union(texts: list[str]) -> str:
    seen: list[str] = []
    for text in texts:
        for part in text.split(" | "):
            if part not in seen:
                seen.append(part)
    return " | ".join(seen)


class ReadableSignatures(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._visit(pkg)

    def _visit(self, obj: griffe.Object) -> None:
        for member in obj.members.values():
            if member.is_alias:
                continue
            if isinstance(member, griffe.Function):
                self._function(member)
            elif isinstance(member, griffe.Attribute):
                if member.value is not None and str(member.value) == member.name:
                    member.value = None  # and the type is the parameter's
                    init = obj.members.get("__init__")
                    if member.annotation is None and isinstance(init, griffe.Function):
                        if member.name in init.parameters:
                            annotation = init.parameters[member.name].annotation
                            member.annotation = readable(annotation)
            elif isinstance(member, griffe.Class | griffe.Module):
                self._visit(member)

    def _function(self, function: griffe.Function) -> None:
        overloads = function.overloads or []
        for overload in overloads:
            _rewrite(overload)
        _rewrite(function)
        if not overloads:
            return
        for parameter in function.parameters:
            if parameter.annotation != "Any":
                continue
            given = [
                str(o.parameters[parameter.name].annotation)
                for o in overloads
                if parameter.name in o.parameters
                and o.parameters[parameter.name].annotation is not None
            ]
            if given:
                parameter.annotation = _union(given)
        if function.returns == "Any":
            returns = [str(o.returns) for o in overloads if o.returns is not None]
            if returns:
                function.returns = _union(returns)
