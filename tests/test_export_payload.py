"""`filterjit.deserialize` refuses every payload it cannot load with one error,
`filterjit.PayloadError`: tampered payloads whose checksum was recomputed (bit
flips, cuts, regions replaced), each tried in a child process so that an abort in
JAX's StableHLO reader is counted, not fatal."""

import base64
import hashlib
import json
import selectors
import subprocess
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import subprocess_env

import filterjit
from filterjit._export._payload import FORMAT, MAGIC


ROOT = Path(__file__).resolve().parent.parent


def _served(model: eqx.nn.MLP, x: jax.Array) -> Any:
    return jax.vmap(model)(x), {"n": 3, "activation": jax.nn.relu}


def _payload() -> bytes:
    model = eqx.nn.MLP(2, 2, 8, 1, key=jax.random.key(0))
    exported = filterjit.export(_served)(model, jnp.ones((4, 2)))
    return exported.serialize(vjp_order=1)


def _parts(data: bytes) -> tuple[bytes, bytes]:
    """A payload's header (JSON bytes) and program."""
    header_length = int.from_bytes(data[len(MAGIC) + 4 : len(MAGIC) + 12], "big")
    start = len(MAGIC) + 20
    return data[start : start + header_length], data[start + header_length : -32]


def _packed(header: bytes, program: bytes) -> bytes:
    """A payload of these bytes, its lengths and checksum made to match."""
    body = MAGIC + FORMAT.to_bytes(4, "big") + len(header).to_bytes(8, "big")
    body += len(program).to_bytes(8, "big") + header + program
    return body + hashlib.sha256(body).digest()


def _variants(data: bytes, count: int, seed: int) -> list[tuple[str, bytes]]:
    """`count` tampered payloads, each with its lengths and checksum recomputed:
    bit flips and cuts in the program and in the header, regions replaced."""
    header, program = _parts(data)
    decoded = json.loads(header)
    rng = np.random.default_rng(seed)
    found: list[tuple[str, bytes]] = []
    replaced = {
        "program zeroed": bytes(len(program)),
        "program random": rng.bytes(len(program)),
        "program empty": b"",
        "program reversed": program[::-1],
        "program's second half zeroed": program[: len(program) // 2]
        + bytes(len(program) - len(program) // 2),
    }
    for name, replacement in replaced.items():
        found.append((name, _packed(header, replacement)))
    crafted = {
        "vjp_order claimed": {**decoded, "vjp_order": 2},
        "private function": {**decoded, "output": ["ref", "jax._src.config:update"]},
        "module __getattr__": {**decoded, "output": ["ref", "jax.numpy:__getattr__"]},
        "donated out of range": {**decoded, "donated": [99]},
        "donated twice": {**decoded, "donated": [0, 0]},
    }
    for name, changed in crafted.items():
        found.append((name, _packed(json.dumps(changed).encode(), program)))
    without_vjp = filterjit.export(jnp.sin)(jnp.ones(3)).serialize()
    sin_header, sin_program = _parts(without_vjp)
    claims = {**json.loads(sin_header), "vjp_order": 1}
    found.append(("no vjp held", _packed(json.dumps(claims).encode(), sin_program)))
    found.append(("another program", _packed(header, sin_program)))
    while len(found) < count:
        kind = rng.integers(4)
        if kind == 0:  # one bit of the program
            flipped = bytearray(program)
            position = int(rng.integers(len(program)))
            flipped[position] ^= 1 << int(rng.integers(8))
            found.append((f"program bit {position}", _packed(header, bytes(flipped))))
        elif kind == 1:  # several bytes of the program
            flipped = bytearray(program)
            positions = rng.integers(len(program), size=int(rng.integers(2, 16)))
            for position in positions:
                flipped[position] = int(rng.integers(256))
            found.append(("program bytes", _packed(header, bytes(flipped))))
        elif kind == 2:  # the program cut
            cut = int(rng.integers(len(program)))
            found.append((f"program cut at {cut}", _packed(header, program[:cut])))
        else:  # one byte of the header
            flipped = bytearray(header)
            position = int(rng.integers(len(header)))
            flipped[position] = int(rng.integers(32, 127))
            found.append((f"header byte {position}", _packed(bytes(flipped), program)))
    return found[:count]


# A child process: tries each payload from the first index given, printing a line
# before each try and one after, so that the parent knows which one aborted it.
CHILD = """
import base64, json, sys
from pathlib import Path

import filterjit

payloads = json.loads(Path(sys.argv[1]).read_text())
for index in range(int(sys.argv[2]), len(payloads)):
    print(json.dumps(["try", index]), flush=True)
    try:
        filterjit.deserialize(base64.b64decode(payloads[index]))
    except BaseException as error:
        region = getattr(error, "region", "")
        outcome = [type(error).__qualname__, region, str(error)[:300]]
    else:
        outcome = ["accepted", "", ""]
    print(json.dumps(["done", index, outcome]), flush=True)
"""


def _outcomes(payloads: list[bytes], folder: Path) -> list[list[str]]:
    """What `deserialize` does with each payload, tried in child processes: an
    outcome `[error type, region, message]`, `accepted`, or `aborted` where the
    process died (or hung, as a corrupted heap can) on it; the next child goes on
    after it."""
    file = folder / "payloads.json"
    file.write_text(json.dumps([base64.b64encode(p).decode() for p in payloads]))
    outcomes: dict[int, list[str]] = {}
    while len(outcomes) < len(payloads):
        start = max(outcomes, default=-1) + 1
        tried, returncode = _child(file, start, outcomes)
        if tried is not None:
            outcomes[tried] = ["aborted", "", f"exit status {returncode}"]
        # Else it died between payloads (a heap an earlier one corrupted): go on.
        assert start in outcomes, f"the child tried nothing (exit {returncode})"
    return [outcomes[i] for i in range(len(payloads))]


def _child(
    file: Path, start: int, outcomes: dict[int, list[str]]
) -> tuple[int | None, int]:
    """Runs CHILD from payload `start`, recording outcomes; returns the payload it
    was trying when it ended (`None` if none) and its exit status. A payload that
    takes more than a minute is taken as a hang: the child is killed."""
    tried = None
    with (
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(file), str(start)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=subprocess_env(XLA_PYTHON_CLIENT_PREALLOCATE="false"),
        ) as child,
        selectors.DefaultSelector() as selector,
    ):
        assert child.stdout is not None
        selector.register(child.stdout, selectors.EVENT_READ)
        while True:
            if not selector.select(timeout=60):
                child.kill()
                break
            line = child.stdout.readline()
            if not line:
                break
            record = json.loads(line)
            if record[0] == "try":
                tried = record[1]
            else:
                outcomes[record[1]] = record[2]
                tried = None
    return tried, child.returncode


def _check(
    variants: list[tuple[str, bytes]], folder: Path
) -> tuple[dict[str, list[str]], dict[str, int]]:
    """Asserts that each payload is refused with `PayloadError` (or loads: a
    flipped bit in a constant makes another valid program), else aborts; returns
    the outcomes by the variants' names, and how many of each kind."""
    outcomes = _outcomes([payload for _, payload in variants], folder)
    wrong = [
        (name, outcome)
        for (name, _), outcome in zip(variants, outcomes)
        if outcome[0] not in ("PayloadError", "accepted", "aborted")
    ]
    assert wrong == []
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome[0]] = counts.get(outcome[0], 0) + 1
    return {name: o for (name, _), o in zip(variants, outcomes)}, counts


def test_a_tampered_program_is_refused_with_the_documented_error(
    tmp_path: Path,
) -> None:
    data = _payload()
    variants = _variants(data, 40, seed=0)
    outcomes, counts = _check(variants, tmp_path)
    # Each region replaced, and each crafted header, is refused, naming where.
    regions = {name: outcome[1] for name, outcome in list(outcomes.items())[:12]}
    assert regions == {
        "program zeroed": "program",
        "program random": "program",
        "program empty": "program",
        "program reversed": "program",
        "program's second half zeroed": "program",
        "vjp_order claimed": "program",
        "private function": "header",
        "module __getattr__": "header",
        "donated out of range": "header",
        "donated twice": "header",
        "no vjp held": "program",
        "another program": "program",  # it holds no derivative
    }
    assert counts.get("PayloadError", 0) >= 20


def test_the_error_is_public_and_a_value_error() -> None:
    assert issubclass(filterjit.PayloadError, ValueError)
    with pytest.raises(filterjit.PayloadError, match="not made by") as caught:
        filterjit.deserialize(b"not a payload")
    assert caught.value.region == "magic"
    data = bytearray(_payload())
    data[len(data) // 2] ^= 1
    with pytest.raises(filterjit.PayloadError, match="checksum") as caught:
        filterjit.deserialize(bytes(data))
    assert caught.value.region == "checksum"


@pytest.mark.slow  # about a minute: 600 payloads, in child processes
def test_payload_fuzz(tmp_path: Path) -> None:
    data = _payload()
    _, counts = _check(_variants(data, 600, seed=1), tmp_path)
    # Reported, for a reader of the slow tier's output (`-s`, or on failure).
    print(f"payload fuzz: {counts}")
    assert counts.get("PayloadError", 0) >= 400
    assert counts.get("aborted", 0) <= 6  # JAX's reader: rare; more is news
