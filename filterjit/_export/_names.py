"""What a payload may name, and by which name: registered classes and functions,
and JAX's and Equinox's own functions among the modules already imported."""

import dataclasses
import enum
import sys
import types
from typing import Any, TypeVar

from ._payload import PayloadError


_T = TypeVar("_T")


# -- Registration: what a payload may name, by the name it names it by.

by_name: dict[str, Any] = {}
names_by_id: dict[int, tuple[str, Any]] = {}  # by identity: `==` is the user's


def is_namedtuple_type(kind: type) -> bool:
    return issubclass(kind, tuple) and hasattr(kind, "_fields")


def is_node_type(kind: type) -> bool:
    """Whether a payload saves instances of `kind` by their fields."""
    return is_namedtuple_type(kind) or dataclasses.is_dataclass(kind)


def fields_of(kind: type) -> list[str]:
    """The fields a node of a registrable type is saved and rebuilt by."""
    if is_namedtuple_type(kind):
        return list(kind._fields)  # pyright: ignore[reportAttributeAccessIssue]
    return [field.name for field in dataclasses.fields(kind)]


def _module_path_name(thing: Any) -> str:
    return f"{thing.__module__}.{thing.__qualname__}"


def _default_name(thing: Any) -> str:
    """`module.QualifiedName`, by the shortest public module that holds `thing`
    (`equinox.nn.MLP`, not `equinox.nn._mlp.MLP`), which outlives private moves."""
    parts = thing.__module__.split(".")
    for end in range(1, len(parts)):
        if parts[end - 1].startswith("_"):
            break
        module = sys.modules.get(".".join(parts[:end]))
        if module is not None and vars(module).get(thing.__qualname__) is thing:
            return f"{module.__name__}.{thing.__qualname__}"
    return _module_path_name(thing)


def state_type() -> Any:
    """`eqx.nn.State`, or `None` where Equinox is not imported."""
    return getattr(getattr(sys.modules.get("equinox"), "nn", None), "State", None)


def is_state_type(kind: object) -> bool:
    return kind is state_type()


def _registrable(thing: Any) -> bool:
    if isinstance(thing, type):
        return (
            is_namedtuple_type(thing)
            or dataclasses.is_dataclass(thing)
            or issubclass(thing, enum.Enum)
            or is_state_type(thing)
        )
    return callable(thing) and hasattr(thing, "__qualname__")


def register_serializable(nodetype: _T, name: str | None = None) -> _T:
    """Lets a saved export hold `nodetype`, and `filterjit.deserialize` rebuild it:
    an `eqx.Module` class, a dataclass, a namedtuple, an `enum.Enum`, or a
    function (saved by reference).

    A payload names the types and functions in it; loading never imports them. The
    loading process registers what it must rebuild, once, before
    `filterjit.deserialize`: the classes of static outputs, enums, and functions of
    its own. Arguments need no registration (a call's arguments are checked
    against the saved class names and static fields), nor do JAX's and Equinox's
    own functions (`jax.nn.relu`, `jnp.tanh`, `lax.max`: saved by name, found among
    the modules already imported), nor `eqx.nn.State`. Saving needs no
    registration: a type is saved under its registered name, or else under
    `module.QualifiedName`, the name that registering it without `name` gives,
    by the shortest public module that holds it (`equinox.nn.MLP`, not the module
    that defines it). A class moved to another module (trained in a script as
    `__main__.Net`, served from `mypkg`) is registered in the loading process under
    the name it was saved by: `register_serializable(Net, name="__main__.Net")`.

    **Arguments:**

    - `nodetype`: the class or function. An instance of a class is rebuilt from its
        fields (dataclasses and Modules) or its items (namedtuples), without
        calling `__init__` or `__post_init__`, as `jax.tree_util` unflattens a
        Module; an enum member by its name; a function is the very object
        registered.
    - `name`: the name to save and load it by; `module.QualifiedName` if omitted
        (and a payload that names it by the module that defines it loads too).

    **Returns:**

    `nodetype`, so that it may be used as a class decorator.

    !!! example

        ```python
        @filterjit.register_serializable
        class Linear(eqx.Module):
            weight: jax.Array
            activation: str = eqx.field(static=True)
        ```
    """
    if not _registrable(nodetype):
        raise TypeError(
            "register_serializable takes an eqx.Module class, a dataclass, a "
            f"namedtuple class, an enum class or a function, not {nodetype!r}."
        )
    if is_state_type(nodetype):
        return nodetype  # saved and rebuilt as it is, with no registration
    name = _default_name(nodetype) if name is None else name
    known = by_name.get(name)
    if known is not None and known is not nodetype:
        raise ValueError(
            f"register_serializable: the name {name!r} is registered for {known!r} "
            f"already; register {nodetype!r} under another name (`name=`)."
        )
    by_name[name] = nodetype
    names_by_id[id(nodetype)] = (name, nodetype)
    if name == _default_name(nodetype):  # payloads that name its module's path
        by_name.setdefault(_module_path_name(nodetype), nodetype)
    return nodetype


def type_name(kind: type) -> str:
    """The name a payload saves a class by."""
    found = names_by_id.get(id(kind))
    return _default_name(kind) if found is None else found[0]


def is_named(kind: type, name: str) -> bool:
    """Whether a payload's class name `name` names `kind`: its name, or the path of
    its module (as payloads saved it before public names)."""
    return name in (type_name(kind), _module_path_name(kind))


# -- JAX's and Equinox's own functions, by the name of a module already imported.

LIBRARY_MODULES = (
    "jax.nn",
    "jax.numpy",
    "jax.lax",
    "jax.scipy.special",
    "jax.random",
    "equinox.nn",
    "equinox",
)
"""The modules whose public callables (functions and classes, their names not
beginning with `_`) a payload may name, best name first."""
PRIVATE_DEFAULTS = ("equinox.nn._mlp:_identity",)
"""Callables a payload may name that no public name holds: defaults of Equinox's
public classes (`eqx.nn.MLP`'s `final_activation`)."""


TOUCHING_FILES_OR_PROCESSES = frozenset(
    {
        "jax.numpy:fromfile",
        "jax.numpy:load",
        "jax.numpy:save",
        "jax.numpy:savez",
        "jax.numpy:printoptions",
        "jax.numpy:set_printoptions",
        "equinox:clear_caches",
        "equinox:default_deserialise_filter_spec",
        "equinox:default_serialise_filter_spec",
        "equinox:filter_pure_callback",
        "equinox:tree_deserialise_leaves",
        "equinox:tree_pprint",
        "equinox:tree_serialise_leaves",
    }
)
"""Public callables of `LIBRARY_MODULES` that no payload may name: they read or
write files, print, call back into Python or change the process's state, which a
model's outputs never need."""


def _referable(value: Any) -> bool:
    return callable(value) and not isinstance(value, types.ModuleType)


def allowed_name(name: str) -> bool:
    """Whether `module:attribute` is among what a payload may name."""
    module_name, _, attribute = name.partition(":")
    public = module_name in LIBRARY_MODULES and not attribute.startswith("_")
    public = public and name not in TOUCHING_FILES_OR_PROCESSES
    return (public and attribute.isidentifier()) or name in PRIVATE_DEFAULTS


def library_name(value: Any) -> str | None:
    """`module:attribute` where a module a payload may name holds `value`, the
    first in `LIBRARY_MODULES`' order (among the modules imported now)."""
    if not _referable(value):
        return None
    for module_name in LIBRARY_MODULES:
        module = sys.modules.get(module_name)
        for attribute, item in list(vars(module).items()) if module else ():
            name = f"{module_name}:{attribute}"
            if item is value and allowed_name(name):
                return name
    return next((n for n in PRIVATE_DEFAULTS if resolve_reference(n) is value), None)


def resolve_reference(name: str) -> Any:
    """What a saved reference names, if this process has it, else `None`. Imports
    nothing; raises `PayloadError` for a name a payload may not name."""
    if name in by_name:
        return by_name[name]
    module_name, colon, attribute = name.partition(":")
    if not colon:
        return None  # a registered name, not registered here
    if not allowed_name(name):
        raise not_allowed(name)
    module = sys.modules.get(module_name)
    value = None if module is None else vars(module).get(attribute)
    return value if _referable(value) else None


def not_allowed(name: str) -> PayloadError:
    return PayloadError(
        "header",
        f"the payload names `{name}`, which is not among what a payload may name "
        "(a crafted payload): the public functions and classes of "
        f"{', '.join(LIBRARY_MODULES)} but those that touch files or processes "
        f"(`TOUCHING_FILES_OR_PROCESSES`), Equinox's defaults "
        f"{', '.join(PRIVATE_DEFAULTS)}, and what `filterjit.register_serializable` "
        "registered.",
    )
