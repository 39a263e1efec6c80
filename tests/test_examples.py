"""Every script in examples/ runs, warning-free, and prints what it is there to show.

Each runs in a subprocess, as a user would run it, so the strict settings of this
test suite (strict dtype promotion) do not apply, and `-W error` makes any warning
fail it.
"""

import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from helpers import BACKEND_START_UP_WARNINGS, subprocess_env, WARNINGS_AS_ERRORS
from test_docs import fenced_blocks, OUTPUT_INFO


ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# Arguments for a quick run, and lines (regular expressions) the output must contain.
EXPECTED: dict[str, tuple[list[str], list[str]]] = {
    "seed_case.py": (
        [],
        [
            r"undecorated +3 of 3",
            r"jax\.jit +0 of 3",
            r"equinox\.filter_jit +0 of 3",
            r"filterjit\.filter_jit +3 of 3",
            r"filterjit\.filter_jit +8\.0, unrolled",
        ],
    ),
    "train_mlp.py": (
        [],
        [r"traces of step: 1\n", r"traces of evaluate: 1\n"],
    ),
    "library_author.py": (
        ["--rounds", "1"],
        [
            r"equinox\.filter_jit +rk4 only +lax\.switch over 8 methods",
            r"filterjit\.filter_jit +rk4 only +rk4 only",
            r"jax\.jit +ValueError: Reverse-mode",
            r"filterjit\.filter_jit +ok, \|grad\| = ",
            r"filterjit\.filter_jit( +\d+\.\d){4} +\d+\.\d\d",
        ],
    ),
    "train_optax.py": (
        ["--rounds", "1"],
        [
            r"traces of the step, optimiser passed in: 1\n",
            r"traces of the step, optimiser closed over: 1\n",
            r"the two trained models differ by \d\.\de[+-]\d\d\n",
            r"jax\.jit, hand-partitioned +\d+\.\d µs +1\.00x jax\.jit",
            r"equinox\.filter_jit +\d+\.\d µs +\d+\.\d\dx jax\.jit",
            r"filterjit, optimiser in +\d+\.\d µs +\d+\.\d\dx jax\.jit",
            r"filterjit, closed over +\d+\.\d µs +\d+\.\d\dx jax\.jit",
        ],
    ),
    "multi_process.py": (
        [],
        [
            r"2 processes x 2 CPU devices: a batch of 64 rows over 4\n",
            r"losses agree to a relative 1e-5: True\n",
            r"traces of step on each process: 1\n",
        ],
    ),
    "scan_vmap.py": (
        [],
        [
            r"Python traces of the decorated helper: 1\n",
            r"with jax\.jit on the helper instead: TracerArrayConversionError",
            r"traces of damp \(vmap, vmap\(grad\)\): 1\n",
            r"after three more batches: 1\n",
            r"jit\(scan\(vmap\)\) +max \|decorated - undecorated\| = \d+ ulp\n",
        ],
    ),
}


# Differences in units of the last place that are rounding: on CPU, where the
# examples' outputs were recorded, at most 2; elsewhere (a GPU's kernels fuse and
# approximate transcendental functions otherwise than op-by-op dispatch does) at
# most 64, 4e-6 of the value in float32. A different trace (a dropped term, another
# dtype) is off by far more.
MAX_ULPS = 2 if jax.default_backend() == "cpu" else 64

# A number as the examples print one (an integer, a decimal, an exponent).
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d*)?(?:e[-+]?\d+)?")


def without_digits(text: str) -> list[str]:
    """`text`'s lines with each number replaced by `#` and runs of spaces made one
    (NumPy pads printed arrays to their widest number)."""
    masked = _NUMBER.sub("#", text.strip("\n"))
    return [re.sub(r" +", " ", line).rstrip() for line in masked.splitlines()]


def run(name: str, args: list[str]) -> str:
    env = subprocess_env(PYTHONWARNINGS=f"error,{BACKEND_START_UP_WARNINGS}")
    env.pop("FILTERJIT_EXPLAIN_RETRACES", None)
    result = subprocess.run(
        [sys.executable, *WARNINGS_AS_ERRORS, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert not result.stderr, result.stderr
    return result.stdout


def documented_outputs() -> dict[str, str]:
    """The outputs docs/examples.md shows, after `python examples/NAME.py`."""
    blocks = fenced_blocks((ROOT / "docs" / "examples.md").read_text())
    shown = {}
    for command, output in zip(blocks, blocks[1:]):
        match = re.fullmatch(r"python examples/(\w+\.py)", command.text.strip())
        if command.info == "bash" and match and output.info == OUTPUT_INFO:
            shown[match[1]] = output.text
    return shown


def test_every_example_is_tested():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)


# Slow examples are in the slow tier (`--full`).
SLOW = {"library_author.py", "multi_process.py"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
        for n in sorted(EXPECTED)
    ],
)
def test_example_runs(name: str):
    args, patterns = EXPECTED[name]
    out = run(name, args)
    for pattern in patterns:
        assert re.search(pattern, out), f"{pattern!r} not in the output:\n{out}"
    if name == "train_mlp.py":
        losses = [float(m) for m in re.findall(r"^ *\d+ +(\d+\.\d+)", out, re.M)]
        assert len(losses) >= 5 and losses[-1] < losses[0] / 5, out
    if name == "train_optax.py":
        losses = [
            float(m) for m in re.findall(r"^ *\d+ +\d\.\d+ +(\d\.\d+)$", out, re.M)
        ]
        assert len(losses) >= 5 and losses[-1] < losses[0] / 10, out
    if name == "scan_vmap.py":
        # Equal, or equal but for rounding: compiled and op-by-op results may differ
        # in the last place, and by how much depends on the XLA of the JAX version.
        differences = re.findall(r"= (\d+) ulp\n", out)
        assert len(differences) == 5, out
        assert all(int(d) <= MAX_ULPS for d in differences), out
    if name == "train_optax.py":
        # The two ways to hand the optimiser to the step train the same model.
        (difference,) = re.findall(r"the two trained models differ by (\S+)\n", out)
        assert float(difference) <= 1e-5, out
    # The page shows a run on one machine; numbers printed elsewhere (a GPU, another
    # CPU) differ in their last digits. What they mean is checked above; the page
    # shows the same lines, and the same text around its numbers.
    shown = documented_outputs().get(name)
    if shown is not None:
        assert without_digits(out) == without_digits(shown), (
            f"docs/examples.md shows another output for {name}; it prints\n{out}"
        )


def test_outputs_are_compared_with_the_page_but_for_their_digits():
    printed = "step  loss\n   0    0.2084\n 250    0.0634\n[-0.67  0.   0.67]\n"
    on_a_gpu = "step  loss\n   0    0.2091\n 250    0.0611\n[-0.6702  0.  0.6702]"
    assert without_digits(printed) == without_digits(on_a_gpu)
    assert without_digits("traces of step: 1") != without_digits("traces of step: x")
    assert without_digits("step 1\nstep 2") != without_digits("step 1")
    assert without_digits("1.0e-05 ulp") == ["# ulp"]


def test_examples_page_shows_outputs():
    assert set(documented_outputs()) == {"seed_case.py", "train_mlp.py", "scan_vmap.py"}
