"""Exporting a filtered function for another process, and loading it: `export`,
`Exported`, `deserialize`, `register_serializable` and `PayloadError`, which
`filterjit` re-exports. Private, as its modules are: named `_export` so that
`filterjit.export` is the function alone. It sits over the core, which never
imports it; its private JAX access lies in `filterjit/_trace.py` with the rest."""
