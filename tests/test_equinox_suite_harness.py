"""The CI leg that runs Equinox's own test suite under `patch_equinox()`
(`.ci/equinox`, the `equinox` leg of `.ci/matrix`, through `benchmarks/peers.py
--check`), on a one-file suite that it takes, as it takes Equinox's, from a
directory holding the installed version's pyproject.toml and tests/: it runs the
suite patched, then released where it did not pass, counts the
`equinox.filter_jit` wrappers each library made, fails on a test that passes
released and fails patched, unless run again alone it passes patched or fails
released too; it fails on a suite of another version, and in CI where it finds
none."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import pytest
from helpers import ROOT, subprocess_env


_SUITE = """
import equinox as eqx

_SEEN = []


def f(x):
    return x + 1


def test_makes_three_wrappers_and_passes_released_only():
    for _ in range(3):
        assert eqx.filter_jit(f)(1.0) == 2.0
    assert eqx.filter_jit.__module__ == "equinox._jit"


def test_notes_the_jit():
    _SEEN.append(eqx.filter_jit.__module__)


def test_fails_patched_after_the_others_and_passes_alone():
    assert not any(module.startswith("filterjit") for module in _SEEN)


def test_fails_both_ways():
    _SEEN.append("failed")
    raise AssertionError("fails both ways")


def test_passes_released_after_a_failure_and_fails_alone():
    assert eqx.filter_jit.__module__ == "equinox._jit" and "failed" in _SEEN
"""


def _suite(directory: Path, version: str) -> Path:
    """`directory`, holding a pyproject.toml of `version` and `tests/test_suite.py`."""
    (directory / "tests").mkdir(parents=True)
    (directory / "pyproject.toml").write_text(
        f'[project]\nname = "equinox"\nversion = "{version}"\n'
    )
    (directory / "tests" / "test_suite.py").write_text(_SUITE)
    return directory


def _leg(
    script: Path, *args: str, **variables: str
) -> subprocess.CompletedProcess[str]:
    """`script ARGS` (`.ci/equinox`, or a copy of it) with `variables` set and no
    other EQUINOX_SUITE or CI, and this interpreter as the `python` on PATH."""
    env = subprocess_env()
    for name in ("EQUINOX_SUITE", "CI"):
        env.pop(name, None)
    env.update(variables)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    return subprocess.run(
        [str(script), *args], capture_output=True, text=True, timeout=600, env=env
    )


# Eight runs of pytest, each importing Equinox: in the slow tier, which CI's main leg
# runs (the leg itself runs only with the main leg's versions).
@pytest.mark.slow
def test_the_equinox_leg_counts_wrappers_and_fails_on_a_regression(tmp_path):
    suite = _suite(tmp_path / "equinox", eqx.__version__)
    out = tmp_path / "outcomes.json"
    script = ROOT / ".ci" / "equinox"
    result = _leg(script, "--json", str(out), EQUINOX_SUITE=str(suite))
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"from $EQUINOX_SUITE ({suite})" in result.stdout, result.stdout
    runs = json.loads(out.read_text())["equinox"]
    unpatched, patched = runs["unpatched"], runs["patched"]

    def outcomes(run: dict) -> dict[str, str]:
        return {n.split("::")[1]: o for n, o in run["outcomes"].items()}

    assert outcomes(patched) == {
        "test_makes_three_wrappers_and_passes_released_only": "failed",
        "test_notes_the_jit": "passed",
        "test_fails_patched_after_the_others_and_passes_alone": "failed",
        "test_fails_both_ways": "failed",
        "test_passes_released_after_a_failure_and_fails_alone": "failed",
    }, patched
    # Released, the tests that did not pass patched, and only those, in order.
    assert list(outcomes(unpatched).items()) == [
        ("test_makes_three_wrappers_and_passes_released_only", "passed"),
        ("test_fails_patched_after_the_others_and_passes_alone", "passed"),
        ("test_fails_both_ways", "failed"),
        ("test_passes_released_after_a_failure_and_fails_alone", "passed"),
    ], unpatched
    # Equinox's wrappers made before the count began (its own, at import) are the
    # ones patch_equinox() swaps, each for one of filterjit's.
    assert unpatched["made"] == {"filterjit": 0, "equinox": 3}, unpatched
    assert patched["made"]["equinox"] == 0, patched
    assert patched["made"]["filterjit"] >= 3, patched
    # The verdict: one regression, which failed patched and passed released alone
    # in each of three rounds; the test that passes patched alone is not one, nor
    # the one that fails alone released too, nor the one that fails both ways.
    assert result.stdout.count(" run again alone, round ") == 3, result.stdout
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(
        "equinox: FAIL: passing unpatched, failing patched in the suite and alone: "
        "1 (tests/test_suite.py::test_makes_three_wrappers_and_passes_released_only)"
    ), last
    assert (
        "patched 1 passed, 4 failed, 0 errors; unpatched (the tests that did not "
        "pass patched) 3 passed, 1 failed, 0 errors"
    ) in last, last
    assert (
        "1 failed patched in the suite and passed run again alone "
        "(tests/test_suite.py::test_fails_patched_after_the_others_and_passes_alone)"
    ) in last, last
    assert (
        "1 failed patched in the suite and failed run again alone unpatched too "
        "(tests/test_suite.py::test_passes_released_after_a_failure_and_fails_alone)"
    ) in last, last


def _checkout(tmp_path: Path) -> Path:
    """A checkout in `tmp_path` holding `.ci/equinox` alone; its script."""
    script = tmp_path / "checkout" / ".ci" / "equinox"
    script.parent.mkdir(parents=True)
    shutil.copy2(ROOT / ".ci" / "equinox", script)
    return script


@pytest.mark.parametrize("shared", ["shared", "../shared"])
def test_the_equinox_leg_reads_shared_and_fails_on_another_version(tmp_path, shared):
    script = _checkout(tmp_path)
    version = eqx.__version__
    suite = _suite(script.parent.parent / shared / f"equinox-{version}", "0.0.1")
    result = _leg(script, CI="true")
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{suite.resolve()} holds Equinox 0.0.1, and Equinox {version} is" in (
        result.stderr
    ), result.stderr
    assert "filterjit in place of" not in result.stdout, result.stdout


def test_the_equinox_leg_fails_in_ci_without_a_suite_and_skips_elsewhere(tmp_path):
    script = _checkout(tmp_path)
    missing = f"no copy of Equinox {eqx.__version__}'s tests"
    in_ci = _leg(script, CI="true")
    assert in_ci.returncode == 1, in_ci.stdout + in_ci.stderr
    assert f".ci/equinox: {missing}" in in_ci.stderr, in_ci.stderr
    elsewhere = _leg(script)
    assert elsewhere.returncode == 0, elsewhere.stdout + elsewhere.stderr
    assert f"== equinox leg: NOT RUN: {missing}" in elsewhere.stdout, elsewhere.stdout
