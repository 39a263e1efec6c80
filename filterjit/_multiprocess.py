"""Static arguments across the processes of a multi-process JAX program.

Each process compiles a top-level call itself: were a static argument to differ
between them, they would compile different programs whose collectives wait on each
other forever. So when a program that spans processes compiles, the processes
compare digests of their static arguments (one small all-gather) and all raise the
same `ValueError`, naming the argument, if they disagree."""

import functools
import hashlib
import os
import re
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, Sharding
from jax.tree_util import PyTreeDef

from ._function import is_partial, opened


# A digest: 64 bits as two uint32 words (without x64, JAX has no 64-bit integers).
_WORDS = 2
# Bytes gathered for an error: a function name or argument label; a value's repr.
_LABEL_BYTES = 160
_REPR_BYTES = 4096
_MAX_DEPTH = 16
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")
_SCALARS = (bool, int, float, complex, str, bytes, type(None), type(Ellipsis))
_NUMBERS = (bool, int, float, complex, np.generic)


def _qualified_name(value: Any) -> str:
    module = getattr(value, "__module__", None) or "?"
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", "?")
    return f"{module}.{name}"


def _type_name(value: Any) -> str:
    return _qualified_name(type(value))


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)  # a str: `repr` raises TypeError for any other result
    except Exception as error:  # a broken __repr__ must not break the call
        return f"<unrepresentable {_type_name(value)}: {_type_name(error)}>"


def canonical(value: Any, _depth: int = 0, _seen: frozenset[int] = frozenset()) -> str:
    """A text for `value`, equal on two processes when the value is: with its type,
    numbers written exactly, memory addresses blanked."""
    if isinstance(value, _SCALARS):  # and subclasses (enums); numbers' reprs are exact
        text = repr(value) if type(value) in _SCALARS else _safe_repr(value)
        return f"{_type_name(value)}:{text}"
    if isinstance(value, PyTreeDef):
        # Its repr shows functions in static fields only as addresses.
        children = ",".join(canonical(c, _depth, _seen) for c in value.children())
        return f"PyTreeDef({canonical(value.node_data(), _depth, _seen)}[{children}])"
    if _depth >= _MAX_DEPTH or id(value) in _seen:
        return f"{_type_name(value)}:..."
    inner = functools.partial(canonical, _depth=_depth + 1, _seen=_seen | {id(value)})
    if isinstance(value, tuple | list):
        return f"{_type_name(value)}({','.join(map(inner, value))})"
    if isinstance(value, set | frozenset):
        # Set order follows string hashes, which are salted per process.
        return f"{_type_name(value)}{{{','.join(sorted(map(inner, value)))}}}"
    if isinstance(value, dict):
        items = ",".join(f"{inner(k)}:{inner(v)}" for k, v in value.items())
        return f"{_type_name(value)}{{{items}}}"
    if isinstance(value, type | types.ModuleType):
        return f"{_type_name(value)}:{_qualified_name(value)}"
    if (pieces := opened(value)) is not None and not is_partial(value):
        return f"method:{_qualified_name(pieces.inside)}@{inner(pieces.args[0])}"
    if isinstance(value, types.FunctionType | types.BuiltinFunctionType):
        return f"function:{_qualified_name(value)}"
    if (wrapped := getattr(value, "__wrapped__", None)) is not None and callable(value):
        return f"{_type_name(value)}:{inner(wrapped)}"  # jax.jit, functools.wraps
    if type(value).__repr__ is object.__repr__:
        # The default repr is only the type and an address: compare the state.
        if isinstance(state := getattr(value, "__dict__", None), dict):
            return f"{_type_name(value)}:{inner(state)}"
        return f"{_type_name(value)}:<opaque>"
    return f"{_type_name(value)}:{_ADDRESS.sub('0x?', _safe_repr(value))}"


def _digest(*texts: str) -> list[int]:
    hasher = hashlib.blake2b(digest_size=4 * _WORDS)
    for text in texts:
        data = text.encode("utf-8", "backslashreplace")
        hasher.update(len(data).to_bytes(8, "little"))
        hasher.update(data)
    return np.frombuffer(hasher.digest(), "<u4").tolist()


def _encode(text: str, size: int) -> np.ndarray:
    data = text.encode("utf-8", "backslashreplace")[:size]
    return np.frombuffer(data.ljust(size, b"\0"), np.uint8).copy()


def _decode(data: np.ndarray) -> str:
    return bytes(np.asarray(data, np.uint8)).rstrip(b"\0").decode("utf-8", "replace")


def _window(text: str, start: int, width: int = 72) -> str:
    """`width` characters of `text` from a little before `start`."""
    if len(text) <= width:
        return text
    low = min(max(0, start - 20), len(text) - width)
    before = "…" if low > 0 else ""
    after = "…" if low + width < len(text) else ""
    return f"{before}{text[low : low + width]}{after}"


@functools.cache
def _gatherer() -> tuple[NamedSharding, Callable[[jax.Array], jax.Array]]:
    """A sharding with a row per process, and a function that replicates its rows."""
    rows = [
        sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
        for p in range(jax.process_count())
    ]
    width = min(len(row) for row in rows)
    mesh = Mesh(np.array([row[:width] for row in rows]), ("processes", "local"))
    replicate = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))
    return NamedSharding(mesh, P("processes")), replicate


def _allgather(array: np.ndarray) -> np.ndarray:
    """`array` of every process, stacked along a new first axis."""
    by_process, replicate = _gatherer()
    # Eagerly, whatever JAX is tracing around the call (an eager jax.grad's JVP).
    with jax.ensure_compile_time_eval():
        rows = jax.make_array_from_process_local_data(
            by_process, array[None], (jax.process_count(), *array.shape)
        )
        return np.asarray(replicate(rows).addressable_data(0))


def _processes(indices: list[int]) -> str:
    shown = ", ".join(str(i) for i in indices[:8])
    more = f" and {len(indices) - 8} more" if len(indices) > 8 else ""
    return f"process{'es' if len(indices) > 1 else ''} {shown}{more}"


def spans_processes(dynamic: Sequence[Any], *shardings: Any) -> bool:
    """Whether a call's program runs on devices of more than one process: a traced
    input is a global array not fully held here, a tracer (which does not say where
    it lives), or a sharding in `shardings` (pytrees) has other processes' devices.
    A call on this process's own arrays alone must not wait for the others."""
    return any(
        isinstance(leaf, Tracer)
        or (isinstance(leaf, jax.Array | Sharding) and not leaf.is_fully_addressable)
        for leaf in [*dynamic, *jax.tree.leaves(shardings)]
    )


def check_statics_agree(name: str, statics: list[tuple[str, object]]) -> None:
    """Raises the same `ValueError` on every process unless all compile `name` with
    the same `statics`: `(label, value)` pairs, the label in the user's terms, the
    value any object. A collective, called before tracing on a cache miss of a
    program that spans processes."""
    if jax.process_count() <= 1:
        return
    pairs = [(label, canonical(value)) for label, value in statics]
    per_argument = [_digest(label, text) for label, text in pairs]
    overall = _digest(*(f"{label}={text}" for label, text in pairs))
    headers = _allgather(np.array([len(statics), *_digest(name), *overall], np.uint32))
    if (headers == headers[0]).all():
        return
    # Every process sees the same data from here: the same collectives and error.
    if not (headers[:, 1 : 1 + _WORDS] == headers[0, 1 : 1 + _WORDS]).all():
        names = [_decode(row) for row in _allgather(_encode(name, _LABEL_BYTES))]
        by_process = "; ".join(f"process {i}: `{n}`" for i, n in enumerate(names[:8]))
        raise ValueError(
            f"The processes compile different functions at the same point ("
            f"{by_process}). Every process of a multi-process program must make the "
            f"same top-level calls of filter_jit-decorated functions in the same "
            f"order, with equal static arguments."
        )
    # A missing argument (a process with fewer statics) is all-ones: no digest.
    digests = np.full((int(headers[:, 0].max()), _WORDS), 2**32 - 1, np.uint32)
    digests[: len(per_argument)] = np.reshape(per_argument, (-1, _WORDS))
    gathered = _allgather(digests)  # (processes, width, words)
    differs = (gathered != gathered[0]).any(axis=(0, 2))
    index = int(np.argmax(differs)) if differs.any() else 0
    if index < len(statics):
        label, value = statics[index]
        kind = type(value).__name__
        described = _ADDRESS.sub("0x…", _safe_repr(value))  # addresses differ anyway
        if kind not in described:
            described += f" ({kind})"
        number = isinstance(value, _NUMBERS)
    else:
        label, described, number = "", "nothing", False
    texts = (_encode(label, _LABEL_BYTES), _encode(described, _REPR_BYTES))
    gathered_texts = _allgather(np.concatenate([*texts, np.array([number], np.uint8)]))
    labels = [_decode(row[:_LABEL_BYTES]) for row in gathered_texts]
    reprs = [_decode(row[_LABEL_BYTES:-1]) for row in gathered_texts]
    # Show each around the first character where they differ.
    start = len(os.path.commonprefix(reprs))
    label = next((text for text in labels if text), "?")
    groups: dict[str, list[int]] = {}
    for process, text in enumerate(reprs):
        groups.setdefault(_window(text, start), []).append(process)
    by_value = "; ".join(
        f"{text} on {_processes(group)}" for text, group in list(groups.items())[:4]
    )
    if len(groups) == 1:  # equal reprs of different values
        by_value += " (equal reprs, but the values differ)"
    advice = "Pass an equal value on every process"
    if gathered_texts[:, -1].any():
        advice += f", or pass `jnp.asarray({label})` so that it is traced"
    raise ValueError(
        f"`{name}` was called with a static argument `{label}` that differs between "
        f"processes: {by_value}. A static value is compiled into the program, so the "
        f"processes would compile different programs and wait on each other. "
        f"{advice}."
    )
