"""Where a call happens, as one of four levels. Ints (an `IntEnum`), as they index
the per-level caches on every call."""

import enum


class Level(enum.IntEnum):
    """The level of a call: what is traced there, and which caches it uses."""

    TOP = 0  # no trace at all: a plain Python call
    EAGER = 1  # only eager transforms (grad, vjp, jvp, linearize, vmap) around it
    STAGED = 2  # a staged computation (jit, make_jaxpr, a scan body, ...) in the chain
    ABSTRACT = 3  # `lower`, `trace`, `eval_shape`: arrays may be ShapeDtypeStructs

    @property
    def description(self) -> str:
        """The level in a user's words, for tables and messages."""
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    Level.TOP: "at the top level",
    Level.EAGER: "under eager transforms",
    Level.STAGED: "inside a staged trace",
    Level.ABSTRACT: "ahead of time",
}

# Module constants: read on every call, faster than the class's attributes.
TOP, EAGER, STAGED, ABSTRACT = Level
LEVELS = len(Level)
