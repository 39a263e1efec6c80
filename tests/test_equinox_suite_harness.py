"""The CI leg that runs Equinox's own test suite under `patch_equinox()`
(`.ci/equinox`, the `equinox` leg of `.ci/matrix`, through `benchmarks/peers.py
--check`), on a one-file suite that it takes, as it takes Equinox's, from a git
directory at the tag of the installed version: it counts the `equinox.filter_jit`
wrappers each library made, fails on a test that passes released and fails
patched, unless run again alone it passes patched or fails released too, and
fails on a suite of another version."""

import json
import os
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


def test_makes_three_wrappers():
    for _ in range(3):
        assert eqx.filter_jit(f)(1.0) == 2.0


def test_passes_released_only():
    assert eqx.filter_jit.__module__ == "equinox._jit"


def test_notes_the_jit():
    _SEEN.append(eqx.filter_jit.__module__)


def test_fails_patched_after_the_others_and_passes_alone():
    assert not any(module.startswith("filterjit") for module in _SEEN)


def test_passes_released_after_the_others_and_fails_alone():
    assert _SEEN == ["equinox._jit"]
"""


def _git(*args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=test", "-c", "user.email=test@example.com", *args],
        check=True,
        capture_output=True,
    )


def _repository(tmp_path: Path, tag: str, version: str) -> Path:
    """A git repository whose commit tagged `tag` holds a pyproject.toml of
    `version` and `tests/test_suite.py`; its git directory."""
    checkout = tmp_path / "equinox"
    (checkout / "tests").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text(
        f'[project]\nname = "equinox"\nversion = "{version}"\n'
    )
    (checkout / "tests" / "test_suite.py").write_text(_SUITE)
    _git("init", "-q", str(checkout))
    _git("-C", str(checkout), "add", ".")
    _git("-C", str(checkout), "commit", "-q", "-m", "suite")
    _git("-C", str(checkout), "tag", tag)
    return checkout / ".git"


def _leg(git_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`.ci/equinox ARGS` with the suite in `git_dir`, and this interpreter as the
    `python` on PATH."""
    env = subprocess_env(EQUINOX_GIT=str(git_dir))
    env.pop("EQUINOX_SUITE", None)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    return subprocess.run(
        [str(ROOT / ".ci" / "equinox"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def test_the_equinox_leg_counts_wrappers_and_fails_on_a_regression(tmp_path):
    version = eqx.__version__
    git_dir = _repository(tmp_path, f"v{version}", version)
    out = tmp_path / "outcomes.json"
    result = _leg(git_dir, "--json", str(out))
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"from the tag v{version} of the git directory {git_dir}" in result.stdout
    runs = json.loads(out.read_text())["equinox"]
    unpatched, patched = runs["unpatched"], runs["patched"]
    assert set(unpatched["outcomes"].values()) == {"passed"}, unpatched
    lost = {n.split("::")[1] for n, o in patched["outcomes"].items() if o != "passed"}
    assert lost == {
        "test_passes_released_only",
        "test_fails_patched_after_the_others_and_passes_alone",
        "test_passes_released_after_the_others_and_fails_alone",
    }, patched
    # Equinox's wrappers made before the count began (its own, at import) are the
    # ones patch_equinox() swaps, each for one of filterjit's.
    assert unpatched["made"] == {"filterjit": 0, "equinox": 3}, unpatched
    assert patched["made"]["equinox"] == 0, patched
    assert patched["made"]["filterjit"] >= 3, patched
    # The verdict: one regression, which failed patched and passed released alone
    # in each of three rounds; the test that passes patched alone is not one, nor
    # the one that fails alone released too.
    assert result.stdout.count(" run again alone, round ") == 3, result.stdout
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("equinox: FAIL: 1 of the 5 tests that pass unpatched "), last
    assert "alone (tests/test_suite.py::test_passes_released_only)" in last, last
    assert (
        "1 failed patched in the suite and passed run again alone "
        "(tests/test_suite.py::test_fails_patched_after_the_others_and_passes_alone)"
    ) in last, last
    assert (
        "1 failed patched in the suite and failed run again alone unpatched too "
        "(tests/test_suite.py::test_passes_released_after_the_others_and_fails_alone)"
    ) in last, last


@pytest.mark.parametrize(
    "tag, held, message",
    [
        ("v{version}", "0.0.1", "holds Equinox 0.0.1, and Equinox {version} is"),
        ("v0.0.1", "0.0.1", "could not extract Equinox's tests at v{version}"),
    ],
    ids=["tests of another version", "a git directory without the tag"],
)
def test_the_equinox_leg_fails_without_the_installed_versions_tests(
    tmp_path, tag, held, message
):
    version = eqx.__version__
    git_dir = _repository(tmp_path, tag.format(version=version), held)
    result = _leg(git_dir)
    assert result.returncode == 1, result.stdout + result.stderr
    assert message.format(version=version) in result.stderr, result.stderr
    assert "filterjit in place of" not in result.stdout, result.stdout
