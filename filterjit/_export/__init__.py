"""Exporting a filtered function for another process, and loading it. Named `_export`
so that `filterjit.export` is the function alone; the core never imports it."""
