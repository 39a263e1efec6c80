"""The harness that runs Equinox's own test suite under `patch_equinox()` in CI
(`benchmarks/peers.py --check`, the `equinox` leg of `.ci/matrix`): it counts the
`equinox.filter_jit` wrappers each library made, and fails on a test that passes
released and fails patched, unless it passes when run again alone."""

from helpers import run_peers


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
"""


def test_the_equinox_suite_harness_counts_wrappers_and_fails_on_a_regression(
    tmp_path,
):
    result, runs = run_peers(tmp_path, "test_suite.py", _SUITE, ["--check"])
    assert result.returncode == 1, result.stdout + result.stderr
    unpatched, patched = runs["unpatched"], runs["patched"]
    assert set(unpatched["outcomes"].values()) == {"passed"}, unpatched
    lost = {n.split("::")[1] for n, o in patched["outcomes"].items() if o != "passed"}
    assert lost == {
        "test_passes_released_only",
        "test_fails_patched_after_the_others_and_passes_alone",
    }, patched
    # Equinox's wrappers made before the count began (its own, at import) are the
    # ones patch_equinox() swaps, each for one of filterjit's.
    assert unpatched["made"] == {"filterjit": 0, "equinox": 3}, unpatched
    assert patched["made"]["equinox"] == 0, patched
    assert patched["made"]["filterjit"] >= 3, patched
    # The verdict: one regression; the test that passes alone is not one.
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("suite: FAIL: 1 of the 4 tests that pass unpatched "), last
    assert "(tests/test_suite.py::test_passes_released_only)" in last, last
    assert (
        "1 failed patched in the suite and passed run again alone "
        "(tests/test_suite.py::test_fails_patched_after_the_others_and_passes_alone)"
    ) in last, last
