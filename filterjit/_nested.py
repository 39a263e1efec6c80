"""A `jax.jit` object called inside a staged trace, as a nested call calls it: one
cached trace, one `jit` equation, whose constants are the caller's (`nested_caller`);
and how many traces such an object holds (`jit_cache_size`)."""

from typing import Any

import jax

from . import _private_jax as jax_private


def jit_cache_size(jitted: object) -> int | None:
    """How many traces the `jax.jit` object `jitted` holds (`None`: JAX won't say)."""
    size: Any = getattr(jitted, "_cache_size", None)
    return None if size is None else int(size())


def nested_caller_public(jitted: object) -> Any:
    return jitted  # the constants stay in its jit equation's jaxpr


def nested_caller_private(jitted: object) -> Any:
    fun = getattr(jitted, "_fun", None)
    info = getattr(jitted, "_jit_info", None)
    if fun is None or info is None:
        return jitted  # not a `jax.jit` object as this knows it
    private = jax_private

    def call_nested(*args: object) -> Any:
        # What `jitted(*args)` does inside a trace, its jaxpr's constants moved to
        # the front of its operands, as JAX moves constants that are tracers: the
        # outer program's constants then, as where undecorated, which a `cond`
        # under `vmap` batches and a rematerialized checkpoint computes again.
        found, operands = private.infer_params(fun, info, args, {})
        params = found.params
        if params["jaxpr"].consts:
            jaxpr, consts = private.separate_consts(params["jaxpr"])
            count = len(consts)
            params = dict(
                params,
                jaxpr=jaxpr,
                in_shardings=(private.UNSPECIFIED,) * count
                + tuple(params["in_shardings"]),
                in_layouts=(None,) * count + tuple(params["in_layouts"]),
                donated_invars=(False,) * count + tuple(params["donated_invars"]),
            )
            operands = [*consts, *operands]
        out = private.jit_p.bind(*operands, **params)
        return jax.tree_util.tree_unflatten(found.out_tree, out)

    return call_nested


# `nested_caller(jitted)`: what calls the `jax.jit` object `jitted` inside a staged
# trace, as `jitted` itself does but for the constants of its trace, which are the
# caller's (see `nested_caller_private`).
nested_caller = (
    nested_caller_public if jax_private.infer_params is None else nested_caller_private
)
