"""`filterjit.export`: a filtered function saved, loaded in a fresh interpreter and
called; the errors; JAX's ahead-of-time signature on filterjit's stages."""

import dataclasses
import functools as ft
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _export_models import Affine, Mode, Pair, Scale
from differential import assert_tree_allclose
from helpers import subprocess_env, TraceCounter

import filterjit
from filterjit import filter_jit


ROOT = Path(__file__).resolve().parent.parent

for _kind in (Scale, Affine, Pair, Mode):
    filterjit.register_serializable(_kind)


def _batch() -> Any:
    (batch,) = jax.export.symbolic_shape("batch")
    return batch


# -- The functions exported, each with its reference (the same call, not exported).


def _affine(params: dict[str, jax.Array], x: jax.Array, n: int) -> jax.Array:
    return (x @ params["w"] + params["b"]) * n


def _vmapped(model: Scale, x: jax.Array) -> jax.Array:
    return jax.vmap(model)(x)


def _with_static_outputs(x: jax.Array, n: int) -> Any:
    return x * n, {"n": n, "tag": "x"}


@filter_jit
def _inner_loss(p: jax.Array, x: jax.Array, k: Any) -> jax.Array:
    # `k` (a NumPy scalar) reaches the nested call concrete, as undecorated: the
    # loop is a scan, which `grad` goes through (a traced `k`: a while_loop).
    return jax.lax.fori_loop(0, k, lambda _, acc: acc + jnp.sin(p * x).sum(), 0.0)


def _grad_of_nested(p: jax.Array, x: jax.Array) -> jax.Array:
    return jax.grad(_inner_loss)(p, x, np.int32(3))


def _grad_undecorated(p: jax.Array, x: jax.Array) -> jax.Array:
    return jax.grad(_inner_loss.__wrapped__)(p, x, np.int32(3))


def _pair(pair: Pair) -> Pair:
    return Pair(pair.first * pair.second, pair.second + 1)


_params = {"w": jnp.arange(6.0).reshape(3, 2), "b": jnp.array([0.5, -0.5])}
_scale = Scale(jnp.array([1.0, 2.0, 3.0]), 2)
_affine_model = Affine(jnp.arange(6.0).reshape(3, 2) / 6, jnp.ones(2), "tanh")


def _x(batch: int, width: int = 3) -> jax.Array:
    return jnp.arange(batch * width, dtype=jnp.float32).reshape(batch, width) / 10


class _Case(NamedTuple):
    exported: filterjit.Exported
    calls: list[tuple[Any, ...]]  # arguments the loading process builds (see SCRIPT)
    reference: Any  # for each call, what the function returns undecorated


def _cases() -> dict[str, _Case]:
    batch = _batch()
    spec = jax.ShapeDtypeStruct((batch, 3), jnp.float32)
    return {
        "dict_and_int": _Case(
            filterjit.export(_affine)(_params, spec, 3),
            [(2,), (5,)],
            [_affine(_params, _x(2), 3), _affine(_params, _x(5), 3)],
        ),
        "module_vmap": _Case(
            filterjit.export(_vmapped)(_scale, spec),
            [(2,), (7,)],
            [_vmapped(_scale, _x(2)), _vmapped(_scale, _x(7))],
        ),
        "static_outputs": _Case(
            filterjit.export(_with_static_outputs)(spec, 3),
            [(4,)],
            [_with_static_outputs(_x(4), 3)],
        ),
        "bound_method": _Case(
            filterjit.export(_affine_model.apply)(spec),
            [(3,)],
            [_affine_model.apply(_x(3))],
        ),
        "nested_grad": _Case(
            filterjit.export(_grad_of_nested)(jnp.ones(3), jnp.ones(3)),
            [()],
            [_grad_undecorated(jnp.ones(3), jnp.ones(3))],
        ),
        "platforms": _Case(
            filterjit.export(_with_static_outputs, platforms=("cpu", "cuda", "tpu"))(
                spec, 3
            ),
            [(2,)],
            [_with_static_outputs(_x(2), 3)],
        ),
        "namedtuple": _Case(
            filterjit.export(_pair)(Pair(jax.ShapeDtypeStruct((2,), jnp.float32), 3)),
            [()],
            [_pair(Pair(jnp.array([1.0, 2.0]), 3))],
        ),
    }


# Run by a fresh interpreter: loads each payload and calls it with the arguments its
# case names (built here, with the same arrays as `_cases`' references), printing
# one JSON line of results. First, before importing or registering any node type,
# it loads a payload whose arguments name one (no registration needed), and tries
# to load one whose output names one (refused). It registers only `Pair`, a class of
# an output.
SCRIPT = """
import json, sys
from pathlib import Path

import jax, jax.numpy as jnp
import filterjit

folder = Path(sys.argv[1])
report = {}
unregistered = filterjit.deserialize((folder / "module_vmap.bin").read_bytes())
report["loaded_unregistered"] = repr(unregistered)
try:
    filterjit.deserialize((folder / "namedtuple.bin").read_bytes())
except filterjit.PayloadError as e:
    report["refused"] = str(e)
report["imported_before"] = [m for m in sys.modules if m.startswith("_export_models")]

from _export_models import Pair, Scale
filterjit.register_serializable(Pair)

def x(batch, width=3):
    return jnp.arange(batch * width, dtype=jnp.float32).reshape(batch, width) / 10

params = {"w": jnp.arange(6.0).reshape(3, 2), "b": jnp.array([0.5, -0.5])}
scale = Scale(jnp.array([1.0, 2.0, 3.0]), 2)
arguments = {
    "dict_and_int": lambda b: ((params, x(b), 3), {}),
    "module_vmap": lambda b: ((scale, x(b)), {}),
    "static_outputs": lambda b: ((x(b),), {"n": 3}),
    "bound_method": lambda b: ((x(b),), {}),
    "nested_grad": lambda: ((jnp.ones(3), jnp.ones(3)), {}),
    "platforms": lambda b: ((x(b), 3), {}),
    "namedtuple": lambda: ((Pair(jnp.array([1.0, 2.0]), 3),), {}),
}

def plain(tree):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return {
        "structure": str(treedef),
        "leaves": [
            ["array", str(leaf.dtype), list(leaf.shape), leaf.tolist()]
            if isinstance(leaf, jax.Array) else [type(leaf).__name__, leaf]
            for leaf in leaves
        ],
    }

for name, make in arguments.items():
    exported = filterjit.deserialize((folder / f"{name}.bin").read_bytes())
    calls = json.loads((folder / f"{name}.json").read_text())
    results = []
    for call in calls:
        args, kwargs = make(*call)
        results.append(plain(exported.call(*args, **kwargs)))
    report[name] = {"platforms": list(exported.platforms), "results": results}
print(json.dumps(report))
"""


def _plain(tree: Any) -> dict[str, Any]:
    # As SCRIPT's `plain`: what a result is, to compare across processes.
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return {
        "structure": str(treedef),
        "leaves": [
            ["array", str(leaf.dtype), list(leaf.shape), np.asarray(leaf).tolist()]
            if isinstance(leaf, jax.Array)
            else [type(leaf).__name__, leaf]
            for leaf in leaves
        ],
    }


def _close(found: dict[str, Any], expected: dict[str, Any]) -> None:
    assert found["structure"] == expected["structure"]
    assert len(found["leaves"]) == len(expected["leaves"])
    for got, want in zip(found["leaves"], expected["leaves"]):
        assert got[:-1] == want[:-1]  # kind (dtype and shape), or the static's type
        if got[0] == "array":
            np.testing.assert_allclose(got[-1], want[-1], rtol=1e-6)
        else:
            assert got[-1] == want[-1]


def _in_a_fresh_interpreter(script: str, *arguments: Path) -> Any:
    """The last line that `script` prints, as JSON, run by a fresh interpreter
    that imports this checkout's filterjit, with `tests/` importable, on this
    process's platforms (what was exported for the default backend loads there;
    on a GPU, not preallocating its memory beside this process)."""
    if jax.default_backend() != "cpu":  # `pytest --device` on an accelerator
        pytest.skip(
            "the fresh interpreter runs on the CPU (this process holds the "
            "accelerator), where what was exported for the accelerator does not "
            "load; the default tier runs this on the CPU"
        )
    result = subprocess.run(
        [sys.executable, "-c", script, *map(str, arguments)],
        capture_output=True,
        text=True,
        env=subprocess_env(ROOT / "tests", XLA_PYTHON_CLIENT_PREALLOCATE="false"),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Any]:
    """The report of one fresh interpreter that loaded and called every case."""
    folder = tmp_path_factory.mktemp("exported")
    cases = _cases()
    for name, case in cases.items():
        (folder / f"{name}.bin").write_bytes(case.exported.serialize())
        (folder / f"{name}.json").write_text(json.dumps(case.calls))
    return _in_a_fresh_interpreter(SCRIPT, folder), cases


@pytest.mark.parametrize(
    "name",
    [
        "dict_and_int",
        "module_vmap",
        "static_outputs",
        "bound_method",
        "nested_grad",
        "platforms",
        "namedtuple",
    ],
)
def test_round_trip_in_a_fresh_interpreter(
    loaded: tuple[dict[str, Any], Any], name: str
) -> None:
    report, cases = loaded
    case = cases[name]
    found = report[name]["results"]
    assert len(found) == len(case.reference)
    for got, reference in zip(found, case.reference):
        _close(got, _plain(reference))


def test_static_outputs_come_back_as_int_and_str(
    loaded: tuple[dict[str, Any], Any],
) -> None:
    report, _ = loaded
    (result,) = report["static_outputs"]["results"]
    assert result["leaves"][1:] == [["int", 3], ["str", "x"]]


def test_module_called_with_two_symbolic_batch_sizes(
    loaded: tuple[dict[str, Any], Any],
) -> None:
    report, _ = loaded
    shapes = [r["leaves"][0][2] for r in report["module_vmap"]["results"]]
    assert shapes == [[2, 3], [7, 3]]


def test_exported_for_several_platforms(loaded: tuple[dict[str, Any], Any]) -> None:
    report, cases = loaded
    assert report["platforms"]["platforms"] == ["cpu", "cuda", "tpu"]
    assert cases["platforms"].exported.platforms == ("cpu", "cuda", "tpu")
    assert report["dict_and_int"]["platforms"] == [jax.export.default_export_platform()]


def test_an_output_naming_an_unregistered_type_is_refused_without_import(
    loaded: tuple[dict[str, Any], Any],
) -> None:
    report, _ = loaded
    assert report["imported_before"] == []
    assert "`_export_models.Pair`" in report["refused"]
    assert "filterjit.register_serializable(Pair)" in report["refused"]


def test_arguments_need_no_registration_to_load_and_call(
    loaded: tuple[dict[str, Any], Any],
) -> None:
    # Finding 2: `Scale` is an argument's class, checked by its saved name and
    # static fields; the loading process never registers it (SCRIPT), and the
    # module_vmap results above come from calling it with a `Scale`.
    report, _ = loaded
    assert report["loaded_unregistered"].startswith("<filterjit.Exported _vmapped")
    assert len(report["module_vmap"]["results"]) == 2


# -- In one process: the exporting process's own `Exported`, and one loaded back.


def _both(exported: filterjit.Exported) -> list[filterjit.Exported]:
    return [exported, filterjit.deserialize(exported.serialize())]


def test_exported_call_matches_filter_jit():
    spec = jax.ShapeDtypeStruct((_batch(), 3), jnp.float32)
    for exported in _both(filterjit.export(_with_static_outputs)(spec, 3)):
        assert_tree_allclose(
            exported.call(_x(6), 3), filter_jit(_with_static_outputs)(_x(6), 3)
        )
        # `n` bound by keyword: the same call.
        assert_tree_allclose(exported.call(_x(2), n=3), _with_static_outputs(_x(2), 3))


def test_exported_of_a_filter_jit_wrapper_and_under_jit():
    wrapper = filter_jit(_affine)
    exported = filterjit.export(wrapper)(_params, jnp.ones((2, 3)), 2)
    assert_tree_allclose(exported.call(_params, _x(2), 2), _affine(_params, _x(2), 2))
    under_jit = jax.jit(lambda x: exported.call(_params, x, 2))(_x(2))
    assert_tree_allclose(under_jit, _affine(_params, _x(2), 2))


def test_jax_exported_of_the_array_leaves():
    exported = filterjit.export(_affine)(_params, jnp.ones((4, 3)), 2)
    jax_exported = exported.exported
    assert isinstance(jax_exported, jax.export.Exported)
    # Its inputs: the arguments' traced leaves, flattened (`params` sorted: b, w).
    assert [a.shape for a in jax_exported.in_avals] == [(2,), (3, 2), (4, 3)]
    (y,) = jax_exported.call(_params["b"], _params["w"], _x(4))
    assert_tree_allclose(y, _affine(_params, _x(4), 2))


def test_a_functions_own_arrays_are_compiled_in():
    # A Module, and a partial: their arrays are not inputs of the program.
    exported = filterjit.export(_scale)(jax.ShapeDtypeStruct((3,), jnp.float32))
    assert [a.shape for a in exported.exported.in_avals] == [(3,)]
    assert_tree_allclose(exported.call(jnp.ones(3)), _scale(jnp.ones(3)))
    partial = ft.partial(_affine, _params)
    loaded = filterjit.deserialize(
        filterjit.export(partial)(
            jax.ShapeDtypeStruct((2, 3), jnp.float32), 2
        ).serialize()
    )
    assert [a.shape for a in loaded.exported.in_avals] == [(2, 3)]
    assert_tree_allclose(loaded.call(_x(2), 2), _affine(_params, _x(2), 2))


def test_a_static_that_differs_names_the_argument_and_both_values():
    spec = jax.ShapeDtypeStruct((_batch(), 3), jnp.float32)
    for exported in _both(filterjit.export(_affine)(_params, spec, 3)):
        with pytest.raises(
            ValueError, match="static argument `n` was 3 when exported and is 4 now"
        ):
            exported.call(_params, _x(2), 4)
        with pytest.raises(ValueError, match="`n` was 3 when exported and is 3.0 now"):
            exported.call(_params, _x(2), 3.0)
    for exported in _both(filterjit.export(_vmapped)(_scale, spec)):
        with pytest.raises(
            ValueError, match="`model.power` was 2 when exported and is 3 now"
        ):
            exported.call(Scale(_scale.weight, 3), _x(2))


def test_another_structure_or_shape_names_the_argument():
    spec = jax.ShapeDtypeStruct((_batch(), 3), jnp.float32)
    for exported in _both(filterjit.export(_affine)(_params, spec, 3)):
        with pytest.raises(
            TypeError,
            match=r"argument `params` has another structure than the export was "
            r"made for \(`params` is a dict with keys \[\"'w'\"\], where the "
            r"export has a dict with keys \[\"'b'\", \"'w'\"\]\)",
        ):
            exported.call({"w": _params["w"]}, _x(2), 3)
        with pytest.raises(
            TypeError,
            match=r"`model` is a `Affine`, where the export has a `Scale`",
        ):
            wrong: Any = _affine_model  # not a `Scale`, on purpose
            filterjit.export(_vmapped)(_scale, spec).call(wrong, _x(2))
        with pytest.raises(
            TypeError,
            match=r"argument `x` is an array of float32\[2, 4\]"
            r", but the export was made for float32\[batch,3\]",
        ):
            exported.call(_params, jnp.ones((2, 4)), 3)
        with pytest.raises(
            TypeError, match=r"argument `params\['b'\]` is an array of int32"
        ):
            exported.call({"w": _params["w"], "b": jnp.ones(2, jnp.int32)}, _x(2), 3)
        with pytest.raises(TypeError, match="argument `x` was an array when exported"):
            exported.call(_params, 1.0, 3)
        with pytest.raises(TypeError, match="takes 3 positional arguments|missing"):
            exported.call(_params, _x(2))


class _NotRegistered(eqx.Module):
    weight: jax.Array


def test_an_unregistered_node_type_names_the_type_and_how_to_register():
    # As an argument, a class needs no registration (finding 2); as an output, it
    # must be rebuilt, so it must be registered.
    exported = filterjit.export(lambda m: m.weight * 2)(_NotRegistered(jnp.ones(2)))
    loaded = filterjit.deserialize(exported.serialize())
    assert_tree_allclose(loaded.call(_NotRegistered(jnp.ones(2))), jnp.full(2, 2.0))
    with pytest.raises(TypeError, match="another structure"):
        loaded.call(Scale(jnp.ones(2), 1))
    exported = filterjit.export(lambda x: _NotRegistered(x * 2))(jnp.ones(2))
    data = exported.serialize()  # saving needs no registration
    with pytest.raises(filterjit.PayloadError) as caught:
        filterjit.deserialize(data)
    message = str(caught.value)
    assert "test_export._NotRegistered`" in message
    assert "filterjit.register_serializable(_NotRegistered)" in message
    assert "never imports" in message


def test_what_cannot_be_saved_is_named_when_saving():
    act = lambda x: x + 1  # noqa: E731  (not JAX's, not registered)
    exported = filterjit.export(lambda x, act: act(x))(jnp.ones(2), act)
    assert_tree_allclose(exported.call(jnp.ones(2), act), act(jnp.ones(2)))
    with pytest.raises(ValueError, match="static argument `act` was"):
        exported.call(jnp.ones(2), jnp.tanh)
    with pytest.raises(TypeError, match="cannot save `act`, a `function`"):
        exported.serialize()


def test_register_serializable_rejects_what_it_cannot_rebuild():
    with pytest.raises(
        TypeError, match="an eqx.Module class, a dataclass, a namedtuple class"
    ):
        filterjit.register_serializable(dict)
    with pytest.raises(ValueError, match="registered for"):
        filterjit.register_serializable(_NotRegistered, name="_export_models.Scale")


def test_not_a_payload():
    with pytest.raises(ValueError, match="not made by"):
        filterjit.deserialize(b"\x00" * 32)


# -- JAX's ahead-of-time signature on filterjit's stages.


def test_traced_lower_takes_lowering_platforms():
    traced = filter_jit(_with_static_outputs).trace(jnp.ones(3), 2)
    assert traced.fun_name == "_with_static_outputs"
    one = traced.lower().as_text()
    two = traced.lower(lowering_platforms=("cpu", "cuda")).as_text()
    assert "_platform_index" in two and "_platform_index" not in one
    lowered = traced.lower(lowering_platforms=(jax.export.default_export_platform(),))
    y, static = lowered.compile()(jnp.ones(3), 2)
    assert y.tolist() == [2.0] * 3 and static == {"n": 2, "tag": "x"}


def test_jax_export_of_filter_jit_points_to_filterjit_export():
    with pytest.raises(TypeError, match=r"filterjit\.export\(f\)"):
        # Not a `jax.stages.Wrapped` to pyright (its stages are filterjit's own).
        wrapped: Any = filter_jit(_affine)
        jax.export.export(wrapped)(_params, jnp.ones((2, 3)), 2)
    # `filterjit.jit` is `jax.jit`: JAX exports it.
    exported = jax.export.export(filterjit.jit(jnp.sin))(jnp.ones(3))
    assert_tree_allclose(exported.call(jnp.ones(3)), jnp.sin(jnp.ones(3)))


def test_lowered_takes_jaxs_keywords():
    lowered = filter_jit(_with_static_outputs).lower(jnp.ones(3), 2)
    assert "loc(" in lowered.as_text(debug_info=True)
    assert "loc(" not in lowered.as_text()
    compiled = lowered.compile(device_assignment=(jax.devices()[0],))
    assert compiled(jnp.ones(3), 2)[0].tolist() == [2.0] * 3


def test_an_export_traces_the_function_once():
    counter = TraceCounter(_with_static_outputs)
    spec = jax.ShapeDtypeStruct((_batch(), 3), jnp.float32)
    exported = filterjit.export(counter)(spec, 3)
    assert counter.count == 1
    exported.call(_x(2), 3)
    exported.call(_x(5), 3)
    assert counter.count == 1


def _with_defaults(x: jax.Array, scale: jax.Array = jnp.array(2.0), *, mode="a"):
    return x * scale if mode == "a" else x - scale


def test_defaults_are_compiled_in_and_keywords_bind_by_name():
    spec = jax.ShapeDtypeStruct((3,), jnp.float32)
    for exported in _both(filterjit.export(_with_defaults)(spec)):
        assert [a.shape for a in exported.exported.in_avals] == [(3,)]
        assert_tree_allclose(exported.call(_x(1)[0]), _with_defaults(_x(1)[0]))
        # Passed as it was left: the same call.
        assert_tree_allclose(
            exported.call(x=_x(1)[0], mode="a"), _with_defaults(_x(1)[0])
        )
        with pytest.raises(ValueError, match="`mode` was 'a' when exported and is 'b'"):
            exported.call(_x(1)[0], mode="b")
        with pytest.raises(TypeError, match="`scale` was left to its default when "):
            exported.call(_x(1)[0], jnp.array(3.0))
    exported = filterjit.export(_with_defaults)(spec, mode="b")
    assert_tree_allclose(
        exported.call(_x(1)[0], mode="b"), _with_defaults(_x(1)[0], mode="b")
    )
    with pytest.raises(TypeError, match="`mode` was passed when exported and is left"):
        exported.call(_x(1)[0])


def test_static_values_round_trip_exactly():
    statics = [1, 1.0, True, -0.0, float("nan"), 1 - 2j, b"\x00b", None, "s"]
    statics += [frozenset({1, 2}), ("a", (2,)), {"k": [3]}]

    def f(x):
        return x, statics

    exported = filterjit.deserialize(filterjit.export(f)(jnp.ones(2)).serialize())
    _, found = exported.call(jnp.ones(2))
    assert [type(x) for x in found] == [type(x) for x in statics]
    assert repr(found) == repr(statics)  # -0.0 and nan included
    assert np.signbit(found[3]) and found[4] != found[4]


# -- Equinox's own models as arguments, loaded by a process that imports nothing of
# the test's (findings 1-8): it builds the same models from the same keys.


def _serve(model: Any, xs: jax.Array) -> jax.Array:
    return jax.vmap(model)(xs)


def _pools(pools: tuple[Any, Any], x: jax.Array) -> Any:
    return pools[0](x), pools[1](x)


def _sequential(model: Any, x: jax.Array) -> jax.Array:
    return model(x)


def _batch_norm(model: Any, state: Any, xs: jax.Array) -> Any:
    vmapped = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    return vmapped(xs, state)


def _statics(x: jax.Array, dtype: Any, storage: Any, mode: Mode) -> Any:
    return x.astype(dtype).astype(storage), dtype, storage, mode


def _size(xs: jax.Array) -> Any:
    return xs * 2, xs.shape[0], {"rows": xs.shape[0] + 1}


def _models() -> dict[str, Any]:
    # As LOADER builds them.
    return {
        "mlp": eqx.nn.MLP(2, 1, 8, 2, key=jax.random.key(0)),
        "pools": (eqx.nn.MaxPool2d(2), eqx.nn.AvgPool2d(2, stride=2)),
        "sequential": eqx.nn.Sequential(
            [eqx.nn.Linear(2, 3, key=jax.random.key(1)), eqx.nn.Lambda(jax.nn.relu)]
        ),
        "batch_norm": eqx.nn.make_with_state(eqx.nn.BatchNorm)(
            3, "batch", mode="batch"
        ),
    }


LOADER = """
import json, sys
from pathlib import Path

import equinox as eqx
import jax, jax.numpy as jnp, numpy as np
import filterjit

folder = Path(sys.argv[1])
imported = sorted(m for m in sys.modules if m.startswith(("_export_models", "test_")))
models = {
    "mlp": eqx.nn.MLP(2, 1, 8, 2, key=jax.random.key(0)),
    "pools": (eqx.nn.MaxPool2d(2), eqx.nn.AvgPool2d(2, stride=2)),
    "sequential": eqx.nn.Sequential(
        [eqx.nn.Linear(2, 3, key=jax.random.key(1)), eqx.nn.Lambda(jax.nn.relu)]
    ),
    "batch_norm": eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="batch"),
}
load = lambda name: filterjit.deserialize((folder / f"{name}.bin").read_bytes())
xs = jnp.arange(6.0, dtype=jnp.float32).reshape(3, 2) / 4
report = {"imported": imported}

mlp = load("mlp")
report["mlp"] = mlp.call(models["mlp"], xs).tolist()
grads = eqx.filter_grad(lambda m: mlp.call(m, xs).sum())(models["mlp"])
grads = jax.tree.leaves(eqx.filter(grads, eqx.is_array))
report["mlp_grad"] = [g.tolist() for g in grads]
report["mlp_in_avals"] = list(mlp.in_avals)[:2]

image = jnp.arange(32.0, dtype=jnp.float32).reshape(2, 4, 4)
report["pools"] = [y.tolist() for y in load("pools").call(models["pools"], image)]
report["sequential"] = load("sequential").call(models["sequential"], xs[0]).tolist()
bn, state = models["batch_norm"]
ys, new_state = load("batch_norm").call(bn, state, jnp.arange(12.0).reshape(4, 3))
report["batch_norm"] = [ys.tolist(), type(new_state).__name__]
report["batch_norm_state"] = [x.tolist() for x in jax.tree.leaves(new_state)]

try:
    load("statics")
except filterjit.PayloadError as e:
    report["statics_refused"] = str(e)
from _export_models import Mode
filterjit.register_serializable(Mode)
y, dtype, storage, mode = load("statics").call(
    jnp.arange(3.0), jnp.bfloat16, np.dtype("float16"), Mode.SERVE
)
report["statics"] = [
    str(y.dtype), dtype is jnp.bfloat16, repr(storage), mode is Mode.SERVE
]

y, rows, extra = load("size").call(jnp.ones((5, 2)))
report["size"] = [type(rows).__name__, rows, extra]

donor = jnp.ones(3)
load("donate").call(donor)
report["donated"] = donor.is_deleted()
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def loaded_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What a fresh interpreter that imports only JAX, Equinox and filterjit gets
    from exports of Equinox's own models and of statics Export v1 refused."""
    folder = tmp_path_factory.mktemp("models")
    models = _models()
    rows = jax.ShapeDtypeStruct((_batch(), 2), jnp.float32)
    bn, state = models["batch_norm"]
    payloads = {
        "mlp": filterjit.export(_serve)(models["mlp"], rows).serialize(vjp_order=1),
        "pools": filterjit.export(_pools)(models["pools"], jnp.ones((2, 4, 4))),
        "sequential": filterjit.export(_sequential)(models["sequential"], jnp.ones(2)),
        "batch_norm": filterjit.export(_batch_norm)(bn, state, jnp.ones((4, 3))),
        "statics": filterjit.export(_statics)(
            jnp.ones(3), jnp.bfloat16, np.dtype("float16"), Mode.SERVE
        ),
        "size": filterjit.export(_size)(rows),
        "donate": filterjit.export(filter_jit(lambda x: x + 1, donate="all"))(
            jnp.ones(3)
        ),
    }
    for name, payload in payloads.items():
        data = payload if isinstance(payload, bytes) else payload.serialize()
        (folder / f"{name}.bin").write_bytes(data)
    return _in_a_fresh_interpreter(LOADER, folder)


_xs = jnp.arange(6.0, dtype=jnp.float32).reshape(3, 2) / 4


def test_an_eqx_mlp_is_saved_as_an_argument_and_differentiated_after_loading(
    loaded_models: dict[str, Any],
) -> None:
    # Findings 1 and 5: its activations (custom_jvp functions, Equinox's identity)
    # are saved by reference; `vjp_order=1` makes the loaded call differentiable.
    mlp = _models()["mlp"]
    assert loaded_models["imported"] == []
    np.testing.assert_allclose(loaded_models["mlp"], _serve(mlp, _xs), rtol=1e-6)
    grads = eqx.filter_grad(lambda m: _serve(m, _xs).sum())(mlp)
    expected = jax.tree.leaves(eqx.filter(grads, eqx.is_array))
    assert len(loaded_models["mlp_grad"]) == len(expected) == 6
    for got, want in zip(loaded_models["mlp_grad"], expected):
        np.testing.assert_allclose(got, want, rtol=1e-5)
    assert loaded_models["mlp_in_avals"] == [
        "model.layers[0].weight",
        "model.layers[0].bias",
    ]


def test_pools_and_sequential_with_lambda_are_saved_as_arguments(
    loaded_models: dict[str, Any],
) -> None:
    models = _models()
    image = jnp.arange(32.0, dtype=jnp.float32).reshape(2, 4, 4)
    for got, want in zip(loaded_models["pools"], _pools(models["pools"], image)):
        np.testing.assert_allclose(got, want)
    np.testing.assert_allclose(
        loaded_models["sequential"],
        _sequential(models["sequential"], _xs[0]),
        rtol=1e-6,
    )


def test_eqx_state_is_an_argument_and_an_output(loaded_models: dict[str, Any]) -> None:
    # Finding 3.
    bn, state = _models()["batch_norm"]
    ys, new_state = _batch_norm(bn, state, jnp.arange(12.0).reshape(4, 3))
    assert loaded_models["batch_norm"][1] == "State"
    np.testing.assert_allclose(loaded_models["batch_norm"][0], ys, rtol=1e-6)
    for got, want in zip(loaded_models["batch_norm_state"], jax.tree.leaves(new_state)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_dtype_and_registered_enum_statics(loaded_models: dict[str, Any]) -> None:
    # Finding 4: an output enum must be registered to be rebuilt; dtypes need not.
    assert "_export_models.Mode" in loaded_models["statics_refused"]
    assert loaded_models["statics"] == ["float16", True, "dtype('float16')", True]
    # NumPy's and ml_dtypes' scalar types, in this process.
    exported = filterjit.export(_statics)(
        jnp.ones(3), np.float16, jnp.bfloat16, Mode.TRAIN
    )
    loaded = filterjit.deserialize(exported.serialize())
    y, dtype, storage, mode = loaded.call(
        jnp.ones(3), np.float16, jnp.bfloat16, Mode.TRAIN
    )
    assert (y.dtype, dtype, storage, mode) == (
        jnp.bfloat16,
        np.float16,
        jnp.bfloat16,
        Mode.TRAIN,
    )
    bfloat16 = jnp.dtype("bfloat16").type  # ml_dtypes' type, not jnp's
    exported = filterjit.export(_statics)(jnp.ones(3), bfloat16, np.int8, Mode.TRAIN)
    loaded = filterjit.deserialize(exported.serialize())
    assert loaded.call(jnp.ones(3), bfloat16, np.int8, Mode.TRAIN)[1] is bfloat16
    with pytest.raises(ValueError, match="`dtype` was the scalar type bfloat16 when"):
        loaded.call(jnp.ones(3), np.float16, np.int8, Mode.TRAIN)


def test_a_symbolic_size_comes_back_as_the_calls_size(
    loaded_models: dict[str, Any],
) -> None:
    # Finding 8, loaded; and in this process, also under an outer `jax.jit`.
    assert loaded_models["size"] == ["int", 5, {"rows": 6}]
    rows = jax.ShapeDtypeStruct((_batch(), 2), jnp.float32)
    exported = filterjit.export(_size)(rows)
    assert exported.call(jnp.ones((3, 2)))[1:] == (3, {"rows": 4})
    assert filter_jit(_size)(jnp.ones((3, 2)))[1:] == (3, {"rows": 4})
    scaled = jax.jit(lambda x: x * exported.call(x)[1])(jnp.ones((4, 2)))
    assert scaled.tolist() == [[4.0, 4.0]] * 4
    assert list(exported.out_avals) == ["output[0]"]


def test_donation_is_kept_by_the_export(loaded_models: dict[str, Any]) -> None:
    # Finding 7.
    assert loaded_models["donated"] is True
    exported = filterjit.export(filter_jit(lambda x: x + 1, donate="all"))(jnp.ones(3))
    x = jnp.ones(3)
    exported.call(x)
    assert x.is_deleted()
    kept = filterjit.export(lambda x: x + 1)(jnp.ones(3))
    y = jnp.ones(3)
    kept.call(y)
    assert not y.is_deleted()


# -- A loader that trusts nothing it reads (findings 9 and 10).

_WEIGHTS = jnp.arange(64, dtype=jnp.float32) + 0.5


class _Weighted(eqx.Module):
    weight: jax.Array

    def __call__(self, x: jax.Array) -> Any:
        return self.weight * x, {"n": 3}


FUZZ = """
import json, sys
from pathlib import Path

import filterjit

data = Path(sys.argv[1]).read_bytes()
mutations = json.loads(Path(sys.argv[2]).read_text())
outcomes = []
for kind, position, bit in mutations:
    if kind == "truncate":
        mutated = data[:position]
    elif kind == "append":
        mutated = data + b"\\x00"
    else:
        mutated = bytearray(data)
        mutated[position] ^= 1 << bit
        mutated = bytes(mutated)
    try:
        filterjit.deserialize(mutated)
    except ValueError as e:
        outcomes.append(["ValueError", str(e)])
    except BaseException as e:
        outcomes.append([type(e).__name__, str(e)])
    else:
        outcomes.append(["accepted", ""])
print(json.dumps(outcomes))
"""


def _regions(data: bytes) -> dict[str, range]:
    """Where a payload's parts lie: as `filterjit/_export/_payload.py` lays them out."""
    magic = len(b"filterjit.export\n")
    header_length = int.from_bytes(data[magic + 4 : magic + 12], "big")
    program_start = magic + 20 + header_length
    weights = data.find(np.asarray(_WEIGHTS).tobytes())
    assert weights > program_start  # the compiled-in weights, inside the program
    return {
        "magic": range(0, magic),
        "format": range(magic, magic + 4),
        "lengths": range(magic + 4, magic + 20),
        "header": range(magic + 20, program_start),
        "program": range(program_start, len(data) - 32),
        "weights": range(weights, weights + _WEIGHTS.nbytes),
        "checksum": range(len(data) - 32, len(data)),
    }


def test_no_truncated_or_bit_flipped_payload_is_accepted(tmp_path: Path) -> None:
    # Run in a fresh interpreter, so that a crash fails this test, not the session.
    data = filterjit.export(_Weighted(_WEIGHTS))(jnp.ones(64)).serialize()
    assert filterjit.deserialize(data).call(jnp.ones(64))[1] == {"n": 3}
    regions = _regions(data)
    rng = np.random.default_rng(0)
    mutations: list[tuple[str, int, int]] = []
    for region in regions.values():
        count = min(len(region), 24)
        for position in rng.choice(np.asarray(region), count, replace=False):
            mutations.append(("flip", int(position), int(rng.integers(8))))
    cuts = {0, 1, 16, 17, 20, 36, 37, len(data) - 33, len(data) - 32, len(data) - 1}
    for region in regions.values():
        cuts |= {region.start, region.start + len(region) // 2, region.stop - 1}
    mutations += [("truncate", cut, 0) for cut in sorted(cuts) if cut < len(data)]
    mutations.append(("append", 0, 0))
    (tmp_path / "payload.bin").write_bytes(data)
    (tmp_path / "mutations.json").write_text(json.dumps(mutations))
    outcomes = _in_a_fresh_interpreter(
        FUZZ, tmp_path / "payload.bin", tmp_path / "mutations.json"
    )
    assert len(outcomes) == len(mutations) > 150
    wrong = [(m, o) for m, o in zip(mutations, outcomes) if o[0] != "ValueError"]
    assert wrong == []
    messages = [message for _, message in outcomes]
    assert any("is truncated" in m for m in messages)
    assert any("checksum does not match" in m for m in messages)
    flipped = [o for m, o in zip(mutations, outcomes) if m[0] == "flip"]
    assert all(
        "corrupt" in message or "not made by" in message or "format" in message
        for _, message in flipped
    )


def _pack(header: dict[str, Any], program: bytes) -> bytes:
    from filterjit._export._payload import pack

    return pack(header, program)


def _unpack(data: bytes) -> tuple[dict[str, Any], bytes]:
    from filterjit._export._payload import unpack

    return unpack(data)


def test_other_versions_and_formats_are_named() -> None:
    from filterjit._export._payload import FORMAT

    data = filterjit.export(_with_static_outputs)(jnp.ones(3), 2).serialize()
    header, program = _unpack(data)
    assert header["jax"] == jax.__version__
    assert header["filterjit"] == filterjit.__version__
    with pytest.raises(ValueError, match=r"exported with JAX 99\.0\.0, and this"):
        filterjit.deserialize(_pack({**header, "jax": "99.0.0"}, program))
    older = filterjit.deserialize(_pack({**header, "jax": "0.4.30"}, program))
    assert older.call(jnp.ones(3), 2)[1] == {"n": 2, "tag": "x"}
    # A payload of format 1 (filterjit before Export v2), and one of a newer format.
    magic = b"filterjit.export\n"
    encoded = json.dumps({"format": 1}).encode()
    version_1 = magic + len(encoded).to_bytes(8, "big") + encoded + program
    with pytest.raises(ValueError, match=r"earlier version of filterjit \(format 1\)"):
        filterjit.deserialize(version_1)
    newer = magic + (FORMAT + 1).to_bytes(4, "big") + data[len(magic) + 4 :]
    with pytest.raises(
        filterjit.PayloadError,
        match=rf"another version of filterjit \(format {FORMAT + 1}\)",
    ):
        filterjit.deserialize(newer)
    with pytest.raises(ValueError, match="truncated"):
        filterjit.deserialize(magic[:5])


def test_a_crafted_header_with_a_valid_checksum_is_refused_clearly() -> None:
    data = filterjit.export(_with_static_outputs)(jnp.ones(3), 2).serialize()
    header, program = _unpack(data)
    argument = header["arguments"][0]
    crafted = [
        {k: v for k, v in header.items() if k != "output"},
        {**header, "output": ["eval", "os.system"]},
        {**header, "output": ["node"]},
        {**header, "output": ["int", "9" * 6000]},
        {**header, "output": ["float", "not hex"]},
        {**header, "output": ["dtype", "object"]},
        {**header, "output": ["tuple", [["traced"]] * 3]},
        {**header, "output": ["dict", [[["list", []], ["none"]]]]},
        {**header, "output": ["frozenset", [["list", []]]]},
        {**header, "output": ["state", ["tuple", [["list", []]]], [["none"]]]},
        {**header, "output": ["list", [["list", []]] * 10] + [["x"]]},
        {**header, "parameters": [["x; import os", 1, False]]},
        {**header, "parameters": [["x", 1, "a default"]]},
        {**header, "names": [["x", 99]]},
        {**header, "arguments": [{**argument, "value": ["node", "a", "b"]}]},
        {**header, "arguments": [{**argument, "labels": [1]}]},
        {**header, "vjp_order": 10**9},
        {**header, "fun_name": None},
    ]
    for bad in crafted:
        with pytest.raises(filterjit.PayloadError, match="header is not valid"):
            filterjit.deserialize(_pack(bad, program))
    with pytest.raises(filterjit.PayloadError, match="program is not what `jax.export"):
        filterjit.deserialize(_pack(header, b"\x00" * 64))
    # Nested past any recursion limit, behind a valid checksum.
    from filterjit._export._payload import FORMAT, MAGIC

    deep = b"[" * 100_000
    body = MAGIC + b"".join(
        n.to_bytes(size, "big") for n, size in ((FORMAT, 4), (len(deep), 8), (0, 8))
    )
    body += deep
    with pytest.raises(ValueError, match="header is not valid"):
        filterjit.deserialize(body + hashlib.sha256(body).digest())


def _kernel(x: jax.Array) -> jax.Array:
    return jax.ffi.ffi_call("my_kernel", jax.ShapeDtypeStruct(x.shape, x.dtype))(x) + 1


def _host_callback(x: jax.Array) -> jax.Array:
    # The target name of `jax.pure_callback` on CPU, as a crafted payload calls it.
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ffi.ffi_call("xla_ffi_python_cpu_callback", out)(x)


def test_custom_calls_are_refused_on_load_unless_allowed_at_export() -> None:
    # Findings 6 and 10: the user's own FFI kernel, allowed with `disabled_checks`.
    allowed = [jax.export.DisabledSafetyCheck.custom_call("my_kernel")]
    exported = filterjit.export(_kernel, disabled_checks=allowed)(jnp.ones(3))
    loaded = filterjit.deserialize(exported.serialize())
    assert loaded.exported.disabled_safety_checks == tuple(allowed)
    with pytest.raises(ValueError, match="custom calls whose targets"):
        filterjit.export(_kernel)(jnp.ones(3))  # as jax.export refuses it
    # A payload whose program calls a target the export did not allow.
    exported.exported = dataclasses.replace(
        exported.exported, disabled_safety_checks=()
    )
    with pytest.raises(ValueError, match="custom call `my_kernel`, which is not"):
        filterjit.deserialize(exported.serialize())
    # A host callback's target holds an address of the exporting process: refused
    # even where the export allowed it (its first call would crash the process).
    target = "xla_ffi_python_cpu_callback"
    callback = filterjit.export(
        _host_callback,
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(target)],
    )(jnp.ones(3))
    with pytest.raises(ValueError, match="`xla_ffi_python_cpu_callback`, a host"):
        filterjit.deserialize(callback.serialize())


def test_canary_private_jax_for_loading() -> None:
    from filterjit._export import _load as private

    # The private reads are in use on this JAX: if one fails here, JAX moved it.
    assert private.stable_targets_private and private.custom_call_targets_private
    assert {"shape_assertion", "Sharding"} <= private.STABLE_TARGETS
    assert private._STABLE_TARGETS_PUBLIC <= private.STABLE_TARGETS
    allowed = [jax.export.DisabledSafetyCheck.custom_call("my_kernel")]
    exported = filterjit.export(_kernel, disabled_checks=allowed)(jnp.ones(3))
    # The public fallback reads the same targets from the module's text.
    assert private._targets_public(exported.exported) == ["my_kernel"]
    assert set(private._targets_private(exported.exported)) == {"my_kernel"}
    plain = filterjit.export(jnp.sin)(jnp.ones(3)).exported
    assert private._targets_private(plain) == private._targets_public(plain) == []


def test_canary_private_jax_reader_of_programs() -> None:
    # The program's serialized form is read by JAX's generated reader before JAX
    # parses it: if it moved, no payload loads (and this says why).
    from filterjit import _private_jax
    from filterjit._export._program import check_serialized

    assert _private_jax.export_flatbuffers is not None
    exported = filterjit.export(jnp.sin)(jnp.ones(3)).exported
    check_serialized(bytes(exported.serialize(vjp_order=1)), 1)


def test_the_loader_without_private_jax(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fallbacks: targets read from the module's text, and a shorter safe list.
    from filterjit._export import _load

    monkeypatch.setattr(_load, "custom_call_targets", _load._targets_public)
    monkeypatch.setattr(_load, "STABLE_TARGETS", _load._STABLE_TARGETS_PUBLIC)
    allowed = [jax.export.DisabledSafetyCheck.custom_call("my_kernel")]
    exported = filterjit.export(_kernel, disabled_checks=allowed)(jnp.ones(3))
    filterjit.deserialize(exported.serialize())
    exported.exported = dataclasses.replace(
        exported.exported, disabled_safety_checks=()
    )
    with pytest.raises(ValueError, match="custom call `my_kernel`, which is not"):
        filterjit.deserialize(exported.serialize())
    spec = jax.ShapeDtypeStruct((_batch(), 3), jnp.float32)
    loaded = filterjit.deserialize(
        filterjit.export(_affine)(_params, spec, 3).serialize()
    )
    assert_tree_allclose(loaded.call(_params, _x(2), 3), _affine(_params, _x(2), 3))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Checked:
    value: jax.Array
    tag: str = dataclasses.field(metadata={"static": True})

    def __post_init__(self) -> None:
        if self.tag == "loaded":
            raise AssertionError("__post_init__ ran on load")


def test_loading_runs_no_init_of_a_registered_class() -> None:
    # Finding 10: a `register_dataclass` class whose `__post_init__` refuses the
    # payload's value; the payload is rebuilt without running it.
    filterjit.register_serializable(_Checked)
    exported = filterjit.export(lambda x: _Checked(x, "exported"))(jnp.ones(2))
    header, program = _unpack(exported.serialize())
    assert header["output"][2][1] == ["tag", ["str", "exported"]]
    header["output"][2][1][1][1] = "loaded"
    loaded = filterjit.deserialize(_pack(header, program))
    for _ in range(2):
        checked = loaded.call(jnp.ones(2))
        assert type(checked) is _Checked and checked.tag == "loaded"
        assert checked.value.tolist() == [1.0, 1.0]


# -- Errors and avals by the user's names (finding 11).


def _add(x: jax.Array, y: jax.Array) -> jax.Array:
    return x + y


def test_a_symbolic_size_that_disagrees_names_both_arguments() -> None:
    spec = jax.ShapeDtypeStruct((_batch(),), jnp.float32)
    for exported in _both(filterjit.export(_add)(spec, spec)):
        with pytest.raises(
            TypeError,
            match=r"`y.shape\[0\]` is 4, but `x.shape\[0\]` is 3, and the export "
            r"has `batch` for both",
        ):
            exported.call(jnp.ones(3), jnp.ones(4))
        assert exported.call(jnp.ones(2), jnp.ones(2)).tolist() == [2.0, 2.0]


def test_a_vmapped_function_is_named_by_the_function_it_wraps() -> None:
    vmapped = jax.vmap(_add)
    for exported in _both(
        filterjit.export(vmapped)(jnp.ones((2, 3)), jnp.ones((2, 3)))
    ):
        assert exported.fun_name == "_add"
        assert list(exported.in_avals) == ["x", "y"]
        with pytest.raises(TypeError, match=r"_add: argument `y` is an array of"):
            exported.call(jnp.ones((2, 3)), jnp.ones((2, 4)))


def _times(x: jax.Array, platforms: float = 2.0, wrapper: float = 3.0) -> jax.Array:
    return x * platforms * wrapper


def test_parameters_named_as_exports_own_are_the_functions() -> None:
    exported = filterjit.export(_times)(jnp.ones(2), platforms=5.0, wrapper=1.0)
    for loaded in _both(exported):
        assert loaded.call(jnp.ones(2), 5.0, wrapper=1.0).tolist() == [5.0, 5.0]
        with pytest.raises(ValueError, match="static argument `platforms` was 5.0"):
            loaded.call(jnp.ones(2), platforms=4.0, wrapper=1.0)


def test_in_and_out_avals_by_name() -> None:
    spec = jax.ShapeDtypeStruct((_batch(), 3), jnp.float32)
    for exported in _both(filterjit.export(_affine)(_params, spec, 3)):
        avals = exported.in_avals
        assert list(avals) == ["params['b']", "params['w']", "x"]
        assert avals["x"].str_short() == "float32[batch,3]"
        assert list(exported.out_avals) == ["output"]
    exported = filterjit.export(_with_static_outputs)(spec, 3)
    assert list(exported.out_avals) == ["output[0]"]
    assert exported.nr_devices == 1
    assert "func.func public @main(%arg0: tensor<?x3xf32>" in exported.mlir_module()
    model = eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0))
    exported = filterjit.export(_serve)(model, jnp.ones((5, 2)))
    assert list(exported.in_avals)[:2] == [
        "model.layers[0].weight",
        "model.layers[0].bias",
    ]


def test_functions_are_saved_by_reference_and_found_without_importing() -> None:
    # Finding 1: JAX's and Equinox's functions by name; a user's once registered.
    def returns(x: jax.Array) -> Any:
        return x, (jax.nn.relu, jnp.tanh, jax.lax.max, _scaled_relu)

    with pytest.raises(TypeError, match=r"cannot save `output\[1\]\[3\]`, a `funct"):
        filterjit.export(returns)(jnp.ones(2)).serialize()
    filterjit.register_serializable(_scaled_relu, name="tests._scaled_relu")
    data = filterjit.export(returns)(jnp.ones(2)).serialize()
    header, program = _unpack(data)
    assert header["output"][1][1][1] == [
        ["ref", "jax.nn:relu"],
        ["ref", "jax.nn:tanh"],  # jnp.tanh, where jax.nn names it
        ["ref", "jax.lax:max"],
        ["ref", "tests._scaled_relu"],
    ]
    _, functions = filterjit.deserialize(data).call(jnp.ones(2))
    assert functions == (jax.nn.relu, jnp.tanh, jax.lax.max, _scaled_relu)
    # A name outside what a payload may name is refused (and nothing is imported
    # to try): private ones too, of modules that are imported.
    before = set(sys.modules)
    for name in (
        "os:system",
        "builtins:eval",
        "jax.not_a_module:f",
        "json:loads",
        "jax._src.config:update",
        "jax.numpy:__getattr__",
        "jax.nn:_private",
        "equinox._module:_wrap_method",
    ):
        header["output"][1][1][1][0] = ["ref", name]
        with pytest.raises(filterjit.PayloadError, match="not among what a payload"):
            filterjit.deserialize(_pack(header, program))
        argument = ["tuple", [["traced"], ["ref", name]]]
        crafted = {
            **header,
            "arguments": [{**header["arguments"][0], "value": argument}],
        }
        with pytest.raises(filterjit.PayloadError, match="not among what a payload"):
            filterjit.deserialize(_pack(crafted, program))
    assert set(sys.modules) == before


def _scaled_relu(x: jax.Array) -> jax.Array:
    return 2 * jax.nn.relu(x)


def _scaled(x: jax.Array, *, factor: float = 1.0, shift: float = 0.0) -> jax.Array:
    return x * factor + shift


def test_a_partial_binding_a_keyword_is_exported() -> None:
    # Its keyword is the function's, not an argument (this raised from `zip`).
    exported = filterjit.export(ft.partial(_scaled, factor=3.0))(jnp.ones(2))
    for exported in _both(exported):
        assert exported.call(jnp.ones(2)).tolist() == [3.0, 3.0]
        assert exported.call(jnp.ones(2), shift=0.0).tolist() == [3.0, 3.0]
        with pytest.raises(TypeError, match=r"called with the arguments \(x, factor"):
            exported.call(jnp.ones(2), factor=2.0)


def _two_lengths(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> Any:
    return params["w"] * x.sum() + y.sum()


def test_a_symbolic_expression_that_disagrees_names_the_argument() -> None:
    (b,) = jax.export.symbolic_shape("b")
    params = {"v": jnp.ones(3), "w": jnp.ones(2)}
    x, y = (jax.ShapeDtypeStruct((n,), jnp.float32) for n in (b, 2 * b))
    for exported in _both(filterjit.export(_two_lengths)(params, x, y)):
        assert exported.call(params, jnp.ones(3), jnp.ones(6)).tolist() == [9.0] * 2
        with pytest.raises(
            TypeError,
            match=r"_two_lengths: `y.shape\[0\]` is 7, but the export has `2\*b` "
            r"there, which is 6 with `b` = 3 \(from `x.shape\[0\]`\)",
        ):
            exported.call(params, jnp.ones(3), jnp.ones(7))
    # An expression alone: its dimension solved from it, or none fits.
    spec = jax.ShapeDtypeStruct((2 * b + 1,), jnp.float32)
    for exported in _both(filterjit.export(_total)(spec)):
        assert float(exported.call(jnp.ones(9))) == 9.0
        with pytest.raises(
            TypeError,
            match=r"_total: `z.shape\[0\]` is 8, but the export has `2\*b \+ 1` "
            r"there, which is 8 for no size `b`",
        ):
            exported.call(jnp.ones(8))


def _total(z: jax.Array) -> jax.Array:
    return z.sum()
