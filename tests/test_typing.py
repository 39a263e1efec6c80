"""Static types (ParamSpec) and runtime type checkers around filter_jit."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import jaxtyping
import pytest
from beartype import beartype
from helpers import subprocess_env
from jaxtyping import Array, Float, jaxtyped

from filterjit import filter_jit


def _find_pyright() -> str | None:
    """The pyright of this interpreter's environment (the test extra installs it
    beside `python`, in the virtualenv's bin, found there also when the virtualenv
    is not activated), else one on PATH; `None` if neither."""
    here = pathlib.Path(sys.executable).parent  # not resolved: a venv's python links
    for name in ("pyright", "pyright.exe"):
        if (candidate := here / name).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("pyright")


def _pyright_messages(tmp_path: pathlib.Path, source: str) -> list[str]:
    """What pyright says of `source`, `reveal_type` lines included."""
    pyright = _find_pyright()
    if pyright is None:
        pytest.skip(
            f"pyright is not installed beside {sys.executable} nor on PATH "
            '(`python -m pip install -e ".[test]"` installs it)'
        )
    snippet = tmp_path / "snippet.py"
    snippet.write_text(textwrap.dedent(source))
    result = subprocess.run(
        [pyright, "--outputjson", "--pythonpath", sys.executable, str(snippet)],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),  # the interpreter's path starts at this checkout
    )
    report = json.loads(result.stdout)
    return [d["message"] for d in report["generalDiagnostics"]]


def test_pyright_is_found_beside_the_interpreter_before_path(monkeypatch, tmp_path):
    # A virtualenv's python run without activating the virtualenv: its bin is not
    # on PATH, and pyright beside python is the one of its environment.
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    python, pyright = bin_dir / "python", bin_dir / "pyright"
    pyright.write_text("#!/bin/sh\n")
    pyright.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(python))
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "pyright").write_text("#!/bin/sh\n")
    (other / "pyright").chmod(0o755)
    monkeypatch.setenv("PATH", str(other))
    assert _find_pyright() == str(pyright)
    # Without one beside python, PATH's; without either, the tests say why they skip.
    pyright.unlink()
    assert _find_pyright() == str(other / "pyright")
    monkeypatch.setenv("PATH", "")
    with pytest.raises(pytest.skip.Exception, match="pyright is not installed beside"):
        _pyright_messages(tmp_path, "x = 1")


def test_reveal_type_keeps_the_parameters(tmp_path):
    messages = _pyright_messages(
        tmp_path,
        """
            import jax
            from filterjit import filter_jit

            @filter_jit
            def f(x: jax.Array, n: int, *, mode: str = "a") -> jax.Array:
                return x * n

            @filter_jit(donate="all")
            def g(x: jax.Array) -> float:
                return 1.0

            class Model:
                @filter_jit
                def apply(self, x: jax.Array, k: int) -> jax.Array:
                    return x

            reveal_type(f)
            reveal_type(g)
            reveal_type(Model().apply)
            f(1)  # a type error: missing argument
            """,
    )
    revealed = [m for m in messages if m.startswith("Type of")]
    assert len(revealed) == 3, messages
    assert (
        'FilterJitWrapper[(x: Array, n: int, *, mode: str = "a"), Array]'
        in (revealed[0])
    ), revealed
    assert "FilterJitWrapper[(x: Array), float]" in revealed[1], revealed
    assert "(x: Array, k: int) -> Array" in revealed[2], revealed
    assert any('"n"' in m and "Argument missing" in m for m in messages), messages


def test_reveal_type_of_filterjit_jit(tmp_path):
    # Finding 6: the wrapper's methods are typed, as jax.jit's are.
    messages = _pyright_messages(
        tmp_path,
        """
            import jax
            import filterjit

            @filterjit.jit
            def f(x: jax.Array, n: int) -> jax.Array:
                return x * n

            @filterjit.jit(static_argnums=1)
            def g(x: jax.Array, n: int) -> jax.Array:
                return x * n

            class Model:
                @filterjit.jit
                def apply(self, x: jax.Array) -> jax.Array:
                    return x

            x = jax.numpy.ones(3)
            reveal_type(f)
            reveal_type(g.lower(x, 2))
            reveal_type(f.trace(x, 2))
            reveal_type(f.eval_shape(x, 2))
            reveal_type(f.clear_cache())
            reveal_type(Model().apply)
            f(x)  # a type error: missing argument
            """,
    )
    revealed = [m for m in messages if m.startswith("Type of")]
    assert len(revealed) == 6, messages
    assert "JitWrapper[(x: Array, n: int), Array]" in revealed[0], revealed
    assert '"Lowered"' in revealed[1] and '"Traced"' in revealed[2], revealed
    assert '"None"' in revealed[4], revealed
    assert "(x: Array) -> Array" in revealed[5], revealed
    assert not [m for m in messages if "Cannot access attribute" in m], messages
    assert any('"n"' in m and "Argument missing" in m for m in messages), messages


def test_filter_jit_over_jaxtyped_checks_shapes_at_trace_time():
    @filter_jit
    @jaxtyped(typechecker=beartype)
    def add(x: Float[Array, " n"], y: Float[Array, " n"]) -> Float[Array, " n"]:
        return x + y

    assert add(jnp.ones(3), jnp.ones(3)).tolist() == [2.0] * 3
    with pytest.raises(jaxtyping.TypeCheckError):
        add(jnp.ones(3), jnp.ones(4))
    with pytest.raises(jaxtyping.TypeCheckError):
        jax.jit(lambda x: add(x, jnp.ones(2)))(jnp.ones(3))


def _scale(x: Float[Array, " n"], k: int) -> Float[Array, " n"]:
    return x * k


def test_beartype_over_filter_jit_checks_every_call():
    # In a fresh interpreter: this test session instruments filterjit itself with
    # beartype (its import hook, tests/conftest.py), and beartype does not decorate
    # twice.
    script = textwrap.dedent(
        """
        import jax.numpy as jnp
        from beartype import beartype
        from beartype.roar import BeartypeCallHintParamViolation
        from jaxtyping import Array, Float
        from filterjit import filter_jit

        def scale(x: Float[Array, " n"], k: int) -> Float[Array, " n"]:
            return x * k

        checked = beartype(filter_jit(scale))
        assert checked(jnp.ones(2), 2).tolist() == [2.0, 2.0]
        for _ in range(2):  # every call, not only the first
            try:
                checked(jnp.ones(2), "a")
            except BeartypeCallHintParamViolation as e:
                assert "k='a' violates type hint" in str(e), e
            else:
                raise AssertionError("not checked")
        print("checked")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )
    assert result.stdout.strip() == "checked", result.stdout + result.stderr


def test_jaxtyped_over_filter_jit_works():
    checked = jaxtyped(typechecker=beartype)(filter_jit(_scale))
    assert checked(jnp.ones(2), 2).tolist() == [2.0, 2.0]
    with pytest.raises(jaxtyping.TypeCheckError):
        checked(jnp.ones(2), "a")  # pyright: ignore[reportArgumentType]
    with pytest.raises(jaxtyping.TypeCheckError):
        checked(jnp.ones((2, 2)), 2)
