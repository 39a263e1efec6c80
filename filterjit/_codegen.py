"""Compiling generated Python: the hot paths of filterjit are straight-line code
written for one structure, one set of leaf types or one shape of call."""

import os
from typing import Any


# Generated code is filed under the package's directory, so that JAX leaves its
# frames out of tracebacks as it does filterjit's other frames.
_GENERATED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "<generated>")


def compile_function(
    name: str, parameters: str, body: list[str], namespace: dict[str, Any]
) -> Any:
    """The function `def name(parameters): body`, its globals `namespace`."""
    source = f"def {name}({parameters}):\n" + "".join(f"    {line}\n" for line in body)
    exec(compile(source, _GENERATED, "exec"), namespace)
    return namespace[name]
