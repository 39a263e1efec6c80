"""`python -m filterjit`: the demo, and its usage with `--help`."""

import subprocess
import sys

import pytest
from helpers import subprocess_env, WARNINGS_AS_ERRORS


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *WARNINGS_AS_ERRORS, "-m", "filterjit", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage_and_runs_nothing(flag: str):
    done = _run(flag)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m filterjit"), done.stdout
    words = " ".join(done.stdout.split())  # argparse wraps to the terminal's width
    assert "jax.jit, equinox.filter_jit and filterjit.filter_jit" in words
    assert "backprop breaks" not in done.stdout  # the demo did not run
    assert done.stderr == ""


def test_an_unknown_argument_is_refused_with_the_usage():
    done = _run("--fast")
    assert done.returncode == 2
    assert done.stdout == ""
    assert "usage: python -m filterjit" in done.stderr
    assert "unrecognized arguments: --fast" in done.stderr


def test_the_demo_shows_filterjit_keeping_each_program():
    done = _run()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    titles = [line for line in lines if line[:2] in ("1.", "2.", "3.")]
    assert len(titles) == 3, done.stdout
    outcomes = [line.split() for line in lines if line.startswith("    ")]
    by_name = {}
    for name, outcome, *_ in outcomes:
        by_name.setdefault(name, []).append(outcome)
    assert by_name["undecorated"] == ["ok"] * 3, done.stdout
    assert by_name["filterjit.filter_jit"] == ["ok"] * 3, done.stdout
    assert "FAIL" in by_name["jax.jit"], done.stdout


def test_each_case_is_labelled_by_what_the_decorators_do():
    """A case whose decorated runs raise says so in its label (not "results
    change", which a run that raises does not do); each label names its failure."""
    done = _run()
    assert done.returncode == 0, done.stderr
    cases = done.stdout.strip().split("\n\n")
    assert len(cases) == 3, done.stdout
    for case in cases:
        title, *rows = case.splitlines()
        outcomes = dict(row.split(None, 1) for row in rows)
        reference = outcomes["undecorated"]
        changed = [
            o for o in outcomes.values() if o.startswith("ok") and o != reference
        ]
        assert not changed and "FAIL" in case, case
        label = title.split(":")[0]
        assert "results change" not in label, title
        assert any(word in label for word in ("raises", "breaks", "no longer")), title
