"""Compiling the generated Python of the fast path: this module owns every `exec`."""

import itertools
import linecache
import os
import weakref
from typing import Any


# Filed under the package's directory, whose frames JAX leaves out of tracebacks,
# each under a name of its own in `linecache`, so tracebacks show its source.
_DIRECTORY = os.path.dirname(os.path.abspath(__file__))
_counter = itertools.count()


def compile_function(
    name: str, parameters: str, body: list[str], namespace: dict[str, Any]
) -> Any:
    """The function `def name(parameters): body`, with globals `namespace` (a new
    dict of its own). The source holds no user data: values are in `namespace`."""
    source = f"def {name}({parameters}):\n" + "".join(f"    {line}\n" for line in body)
    filename = os.path.join(_DIRECTORY, f"<generated {name} {next(_counter)}>")
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = dict(namespace)
    exec(compile(source, filename, "exec"), namespace)
    function = namespace[name]
    # The source lives as long as the function: caches dropped, code gone.
    weakref.finalize(function, linecache.cache.pop, filename, None)
    return function
