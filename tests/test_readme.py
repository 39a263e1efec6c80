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
    ):
        assert command in text
