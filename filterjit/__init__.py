"""filterjit: a filtered `jax.jit` whose nested calls are semantic no-ops."""

from ._jit import filter_jit as filter_jit
from ._partition import is_array as is_array


__version__ = "0.1.0"
