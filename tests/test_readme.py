"""The README's code runs as shown."""

import pathlib
import re

import pytest


README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_code_blocks():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 3
    namespace: dict = {}
    # The first block shows the problem: its last statement fails under jax.jit.
    with pytest.raises(ValueError, match="Reverse-mode differentiation"):
        exec(blocks[0], namespace)
    for block in blocks[1:]:
        exec(block, namespace)
    assert (
        namespace["jax"].jit(
            lambda: namespace["jax"].grad(namespace["filter_jit"](namespace["f"]))(
                0.0, namespace["np"].int32(0)
            )
        )()
        == 1.0
    )
    assert namespace["filterjit"].num_traces(namespace["step"]) == 1


def test_readme_commands():
    text = README.read_text()
    for command in (
        'pip install -e ".[test]"',
        "python -m filterjit",
        "python -m pytest",
        "python -m pytest --full",
    ):
        assert command in text


def test_ci_runs_the_readme_commands():
    """CI installs as the README says before anything else, and runs its demo and
    its test command (with the slow tier)."""
    ci = (README.parent / ".ci" / "run").read_text()
    commands = [line.split("#")[0].strip() for line in ci.splitlines()]
    installs = [c for c in commands if "pip install" in c]
    assert installs[0] == 'python -m pip install -e ".[test]"', installs
    assert 'python -m pip install -e ".[test,dev,docs,bench]"' in installs
    assert "python -m filterjit" in commands
    assert "python -m pytest --full" in commands


def test_quickstart_is_the_one_in_getting_started():
    getting_started = (README.parent / "docs" / "getting-started.md").read_text()
    quickstart = README.read_text().split("## Quickstart", 1)[1]
    bash = re.compile(r"```bash\n(.*?)```", re.S)
    assert bash.findall(quickstart)[0] == bash.findall(getting_started)[0]


def test_ci_runs_the_matrix():
    """CI runs the floor and newest legs after the main one, and each leg runs the
    README's test command."""
    ci = (README.parent / ".ci" / "run").read_text()
    commands = [line.split("#")[0].strip() for line in ci.splitlines()]
    assert ".ci/matrix floor newest" in commands
    assert commands.index(".ci/matrix floor newest") > commands.index(
        "python -m pytest --full"
    )
    matrix = (README.parent / ".ci" / "matrix").read_text()
    matrix_commands = [line.split("#")[0].strip() for line in matrix.splitlines()]
    assert "python -m pytest" in matrix_commands


def test_floor_leg_pins_the_lower_bounds():
    """`.ci/floor.txt` pins every runtime dependency at its lower bound in
    pyproject.toml: the floor leg tests what the bounds promise."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    pyproject = tomllib.loads((README.parent / "pyproject.toml").read_text())
    floors = {}
    for dependency in pyproject["project"]["dependencies"]:
        requirement = Requirement(dependency)
        lower = [s.version for s in requirement.specifier if s.operator == ">="]
        assert len(lower) == 1, dependency
        floors[requirement.name] = Version(lower[0])
    pins = {}
    for line in (README.parent / ".ci" / "floor.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name] = Version(version)
    assert pins == floors
