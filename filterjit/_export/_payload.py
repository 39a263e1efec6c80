"""The bytes of a saved export: a versioned header and the program, and a checksum.
Unpacking trusts nothing it reads: it raises a `PayloadError` saying where."""

import hashlib
import json
import re
import struct
from typing import Any

import jax


MAGIC = b"filterjit.export\n"
FORMAT = 4
"""The payload format this version of filterjit writes and reads."""

# After the magic: the format, the header's length and the program's length; after
# the header and the program, the SHA-256 of everything before it.
_PREFIX = struct.Struct(">IQQ")
_DIGEST = 32
_START = len(MAGIC) + _PREFIX.size
_WHERE = "filterjit.deserialize"


def _version_tuple(version: str) -> tuple[int, ...] | None:
    match = re.match(r"^(\d+)\.(\d+)\.(\d+)", version)
    return None if match is None else tuple(int(part) for part in match.groups())


def pack(header: dict[str, Any], program: bytes) -> bytes:
    """A payload of `header` (JSON data) and `program` (a serialized
    `jax.export.Exported`)."""
    encoded = json.dumps(header, allow_nan=False).encode("utf-8")
    body = MAGIC + _PREFIX.pack(FORMAT, len(encoded), len(program)) + encoded + program
    return body + hashlib.sha256(body).digest()


class PayloadError(ValueError):
    """Raised by `filterjit.deserialize` for every payload it refuses: truncated,
    corrupt, of another format or of a newer JAX, crafted (a header or program
    that `Exported.serialize()` cannot have written, a function outside what a
    payload may name, a program calling a custom call it may not, or beyond the
    loader's limits), or returning a class or function this process has not
    registered.

    A `ValueError`; `region` says which part of the payload is refused: `"magic"`,
    `"format"`, `"lengths"`, `"checksum"`, `"header"` or `"program"`. The message
    says what was expected there.

    !!! example

        ```python
        try:
            served = filterjit.deserialize(data)
        except filterjit.PayloadError as error:
            print(error.region, error)
        ```
    """

    region: str
    """The part of the payload refused."""

    def __init__(self, region: str, what: str):
        super().__init__(f"{_WHERE}: {what}")
        self.region = region


class _DuplicateKey(Exception):
    pass


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused where a key appears twice (which JSON readers
    disagree on: the last one wins here, the first elsewhere)."""
    found: dict[str, Any] = {}  # keys are strings, whose hashes Python randomizes
    for key, value in pairs:
        if key in found:
            raise _DuplicateKey(key)
        found[key] = value
    return found


def unpack(data: bytes) -> tuple[dict[str, Any], bytes]:
    """The header and the program of a payload that `pack` made, its checksum and
    versions checked. Raises a `PayloadError` saying what is wrong otherwise."""
    if not data.startswith(MAGIC):
        if MAGIC.startswith(data):
            raise PayloadError(
                "magic",
                f"the payload is truncated ({len(data)} bytes, not even its "
                "header). Save it again.",
            )
        raise PayloadError(
            "magic",
            "these bytes were not made by `filterjit.Exported.serialize()` (they do "
            f"not begin with {MAGIC!r}, as a filterjit payload does).",
        )
    if len(data) < _START + _DIGEST:
        raise PayloadError(
            "lengths",
            f"the payload is truncated ({len(data)} bytes, shorter than its fixed "
            f"header and checksum, {_START + _DIGEST} bytes). Save it again.",
        )
    form, header_length, program_length = _PREFIX.unpack_from(data, len(MAGIC))
    if form != FORMAT:
        # Format 1 had no format field: its header's length begins with zeros.
        which = "an earlier" if form < FORMAT else "another"
        raise PayloadError(
            "format",
            f"the payload was made by {which} version of filterjit (format "
            f"{form or 1}), or is corrupt; this version reads "
            f"format {FORMAT}. Export it again with this version of filterjit.",
        )
    expected = _START + header_length + program_length + _DIGEST
    if len(data) != expected:
        state = (
            "truncated (or its lengths corrupt)" if len(data) < expected else "corrupt"
        )
        raise PayloadError(
            "lengths",
            f"the payload is {state}: it has {len(data)} bytes where its header "
            f"gives {expected}. Save it again.",
        )
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise PayloadError(
            "checksum",
            "the payload is corrupt: its checksum does not match its contents (a "
            "changed or damaged byte). Save it again.",
        )
    try:
        header = json.loads(
            data[_START : _START + header_length].decode("utf-8"),
            object_pairs_hook=_object,
        )
    except _DuplicateKey as error:
        raise PayloadError(
            "header",
            f"the payload's header is not valid (a crafted payload): its key "
            f"{str(error)[:80]!r} appears twice in one object, which "
            "`serialize()` never writes.",
        ) from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        header = None
    if not isinstance(header, dict):
        raise PayloadError(
            "header",
            "the payload's header is not valid (a corrupt payload): it is not the "
            "JSON object that `serialize()` writes.",
        )
    made_with = header.get("jax")
    version = _version_tuple(made_with) if isinstance(made_with, str) else None
    here = _version_tuple(jax.__version__)
    if version is None or not isinstance(header.get("filterjit"), str):
        raise PayloadError(
            "header",
            "the payload's header is not valid: it names no JAX version "
            "(`major.minor.patch`) or no filterjit version.",
        )
    if here is not None and version > here:
        raise PayloadError(
            "header",
            f"the payload was exported with JAX {made_with}, and this process has "
            f"JAX {jax.__version__}, which may not run a newer JAX's program. Load "
            f"it with JAX {made_with} or newer, or export it again with JAX "
            f"{jax.__version__}.",
        )
    return header, data[_START + header_length : -_DIGEST]
