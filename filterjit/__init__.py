"""filterjit: a filtered `jax.jit` whose nested calls are semantic no-ops."""

from ._diagnostics import (
    Explanation as Explanation,
    RetraceWarning as RetraceWarning,
    set_retrace_warning_threshold as set_retrace_warning_threshold,
)
from ._export._exported import Exported as Exported
from ._export._load import deserialize as deserialize
from ._export._names import register_serializable as register_serializable
from ._export._payload import PayloadError as PayloadError
from ._export._save import export as export
from ._introspect import (
    clear_caches as clear_caches,
    explain as explain,
    num_traces as num_traces,
)
from ._jax_jit import jit as jit
from ._jit import filter_jit as filter_jit
from ._leaves import is_array as is_array
from ._patch import (
    EquinoxPatch as EquinoxPatch,
    patch_equinox as patch_equinox,
    unpatch_equinox as unpatch_equinox,
)


__version__ = "0.1.0"  # the one version source: pyproject.toml reads it (hatch)
