"""Run another library's test suite twice: as it is, and with `equinox.filter_jit`
replaced by `filterjit.filter_jit`, and print what changed, as markdown.

    # one suite: a checkout of the library, then pytest's arguments
    python benchmarks/peers.py /tmp/src/equinox -- tests/test_jit.py

    # several, each named: --suite NAME DIRECTORY "PYTEST ARGUMENTS"
    python benchmarks/peers.py \\
        --suite equinox-jit /tmp/src/equinox "tests/test_jit.py" \\
        --suite lineax /tmp/src/lineax "tests"

Each run is a subprocess `python -m pytest` started in the suite's directory, with
that directory as pytest's rootdir, so the suite's own configuration
(`pyproject.toml`, `conftest.py`, `filterwarnings`, `--jaxtyping-packages`) applies,
not filterjit's. A small plugin, written to a temporary directory and loaded with
`-p`, does the patching: it imports Equinox after the jaxtyping import hook is in
place and before the suite's `conftest.py` files, and in the patched run calls
`filterjit.patch_equinox()` there, and the report says how many Equinox wrappers
that swapped and left. Libraries built on Equinox decorate their entry points when
they are imported, so they get filterjit's.
The unpatched run loads the same plugin and imports Equinox at the same point,
without patching, so that the two runs differ only in the patch. filterjit is
imported from this checkout. The plugin also records every test's outcome, and
refuses network connections other than to the local machine.

Each run has a time limit (`--timeout`, per run); a run that exceeds it is killed,
and the tests it had finished are still reported. If pytest dies (XLA crashing in
a compile, say), the run resumes past the test it died in, which counts as an
error. Each executable XLA compiles holds memory maps, and a suite that compiles
thousands of them reaches the kernel's limit and crashes: between tests, where a
process holds more than half that limit, JAX's caches are cleared, in both runs
alike (`--no-clear` to never do so). The report says where either happened.

Everything is written under one temporary directory, removed at the end (`--keep
DIR` keeps the pytest logs and the raw results); pytest's cache and bytecode files
are not written into the suite's checkout, and anything else a run writes there is
removed. `--rev REV` tests filterjit as committed at REV rather than the working
tree; `--json FILE` writes every test's outcome. Each run counts the
`equinox.filter_jit` wrappers that filterjit and Equinox made during it.

`--check` (what CI's equinox leg runs, .ci/equinox) runs the suite patched, then
unpatched only the tests that did not pass patched (one that passes patched is no
loss, whatever it does unpatched: the comparison of two whole runs in about half
the time), runs each test that passes unpatched and not patched again alone,
unpatched then patched, up to three times, then prints a closing line per suite,
and exits 1 if such a test failed patched each time and passed unpatched each time
(or the patched run ran no test, a run timed out, or was not patched). A test that
fails only under load (a timing test) passes patched once, or fails unpatched too;
either way it is named, not counted.

`--target jax.jit` puts `filterjit.jit` in place of `jax.jit` instead, for JAX's own
tests (a checkout of JAX's tests at the tag of the installed version). The plugin
imports no Equinox. Before the suite's conftest.py files and test modules are
imported, it replaces `jax.jit` (and `jax._src.api.jit`, the tests' `api.jit`) by a
function that looks at its caller: a call from a file of the suite's checkout
makes a `filterjit.jit` in the patched run (a `jax.jit` in the other), whatever
the spelling (`from jax import jit`, `jax.jit`, `api.jit`, `partial(jax.jit,
...)`, a module-level decorator, a parameterized value); a call from anywhere
else (JAX's own modules, filterjit) makes a `jax.jit`, as JAX's own modules that
bound `jit` when they were imported do anyway. Both runs count the calls of
each kind and the report gives the counts, with the modules of the calls left to
`jax.jit`.

    tag=jax-v$(python -c 'import jax; print(jax.__version__)')
    git --git-dir=JAXREPO archive $tag pyproject.toml conftest.py tests \
        | tar -x -C /tmp/jax-src
    python benchmarks/peers.py --target jax.jit /tmp/jax-src \
        -- tests/api_test.py

Not part of filterjit's test run: the suites and their dependencies are not
filterjit's. See docs/migration.md for the suites measured, the commands, and the
results.
"""

import argparse
import dataclasses
import importlib.util
import itertools
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
PLUGIN = "_filterjit_peers_plugin"
RUNS = ("unpatched", "patched")
# How many times a run that crashed resumes past the test it crashed in.
MAX_CRASHES = 5
# How many times `--check` runs a test that passes unpatched and not patched
# again alone, each way.
ROUNDS = 3


@dataclasses.dataclass(frozen=True)
class Target:
    replaced: str  # what filterjit goes in place of
    seen: str  # what the report says the runs saw: the name the tests call


TARGETS = {
    "equinox": Target("equinox.filter_jit", "equinox.filter_jit"),
    "jax.jit": Target("jax.jit", "jax.jit"),
}

# The plugin pytest loads with `-p`. It is copied into the run's own directory
# rather than imported from here, so that the subprocess imports nothing of this
# repository but filterjit itself.
PLUGIN_SOURCE = Path(__file__).with_name("_peers_plugin.py")


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    directory: Path
    args: tuple[str, ...]


@dataclasses.dataclass
class Run:
    """One pytest run of a suite: each test's outcome and first error line."""

    outcomes: dict[str, str]  # nodeid -> passed/failed/error/skipped
    messages: dict[str, str]  # nodeid -> first line of the error
    wall: float
    cpu: float  # user + system time of the run's processes
    returncode: int | None
    timed_out: bool
    filter_jit: str  # the equinox.filter_jit, or the tests' jit, the run saw
    made: dict[str, int | None]  # equinox.filter_jit wrappers made, by library
    notes: list[str]
    log: str

    def count(self, outcome: str) -> int:
        return sum(1 for o in self.outcomes.values() if o == outcome)


def _collate(entries: list[dict]) -> tuple[dict[str, str], dict[str, str]]:
    """Per test, the outcome pytest's summary line counts it under (an xfail as
    skipped, an xpass as passed), and the first line of its error. A test the run
    did not finish (it was killed) is left out."""
    phases: dict[str, dict[str, dict]] = {}
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    for entry in entries:
        if entry["event"] == "collect":
            outcomes[entry["nodeid"]] = "error"
            messages[entry["nodeid"]] = entry["message"]
        elif entry["event"] == "test":
            # A test's subtests (unittest's `subTest`) report under its node id
            # before the test itself does: one that failed fails the test.
            by_when = phases.setdefault(entry["nodeid"], {})
            before = by_when.get(entry["when"])
            if before is None or before["outcome"] != "failed":
                by_when[entry["when"]] = entry
    for nodeid, by_when in phases.items():
        outcome = {when: e["outcome"] for when, e in by_when.items()}
        if outcome.get("setup") == "failed":
            failed, result = "setup", "error"
        elif outcome.get("call") == "failed":
            failed, result = "call", "failed"
        elif outcome.get("teardown") == "failed":
            failed, result = "teardown", "error"
        elif "skipped" in outcome.values():
            failed, result = None, "skipped"
        elif outcome.get("call") == "passed":
            failed, result = None, "passed"
        else:
            continue
        outcomes[nodeid] = result
        if failed is not None:
            messages[nodeid] = by_when[failed].get("message", "")
    return outcomes, messages


def _tree(directory: Path) -> set[Path]:
    """Every path under `directory`, not following links."""
    found = set()
    for parent, dirnames, filenames in os.walk(directory):
        found.update(Path(parent, name) for name in dirnames + filenames)
    return found


def _remove_new(directory: Path, before: set[Path]) -> list[Path]:
    """Removes every path under `directory` that is not in `before`, and says
    which."""
    written = sorted(_tree(directory) - before)
    for path in reversed(written):  # deepest first
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return written


def _entries(results: Path) -> list[dict]:
    """What the plugin recorded so far."""
    entries = []
    if results.exists():
        for line in results.read_text(encoding="utf-8").splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:  # the last line of a killed run
                pass
    return entries


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _children_cpu() -> float:
    """User and system time of this process's waited-for children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _terminate(process: subprocess.Popen[bytes]) -> None:
    """End the run and everything it started (its own process group)."""
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_suite(
    suite: Suite,
    target: str,
    patched: bool,
    workdir: Path,
    timeout: float,
    clear_caches: bool,
) -> Run:
    label = "patched" if patched else "unpatched"
    base = workdir / f"{suite.name}-{label}"
    base.mkdir(parents=True)
    (base / "tmp").mkdir()
    results = base / "results.jsonl"
    log = base / "pytest.log"
    env = dict(os.environ)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(
                [str(workdir / "plugin")]
                + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
            ),
            "FILTERJIT_PEERS_RESULTS": str(results),
            "FILTERJIT_PEERS_PATCH": "1" if patched else "0",
            "FILTERJIT_PEERS_TARGET": target,
            "FILTERJIT_PEERS_SUITE": str(suite.directory),
            "FILTERJIT_PEERS_CLEAR": "1" if clear_caches else "0",
            "PYTHONDONTWRITEBYTECODE": "1",
            "TMPDIR": str(base / "tmp"),
            "MPLBACKEND": "Agg",
            # Clients that honour these fail fast; the plugin refuses the rest.
            "http_proxy": "http://127.0.0.1:9",
            "https_proxy": "http://127.0.0.1:9",
            "HTTP_PROXY": "http://127.0.0.1:9",
            "HTTPS_PROXY": "http://127.0.0.1:9",
            "no_proxy": "",
            "NO_PROXY": "",
        }
    )
    done = base / "done.txt"  # tests not to run again after a crash
    env["FILTERJIT_PEERS_DONE"] = str(done)
    if importlib.util.find_spec("pytest_benchmark") is not None:
        # Its default storage is ./.benchmarks, in the suite's checkout.
        extra = [f"--benchmark-storage=file://{base / 'benchmarks'}"]
    else:
        extra = []
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        PLUGIN,
        "-p",
        "no:cacheprovider",
        f"--rootdir={suite.directory}",
        f"--basetemp={base / 'basetemp'}",
        "--tb=short",
        "-q",
        *extra,
        *suite.args,
    ]
    notes: list[str] = []
    before = _tree(suite.directory)
    process: subprocess.Popen[bytes] | None = None
    timed_out = False
    crashes: dict[str, str] = {}  # nodeid -> how pytest died in it
    start, start_cpu = time.perf_counter(), _children_cpu()
    try:
        with open(log, "wb") as out:
            while True:
                out.write(f"$ cd {shlex.quote(str(suite.directory))}\n".encode())
                out.write(f"$ {shlex.join(command)}\n".encode())
                out.flush()
                process = subprocess.Popen(
                    command,
                    cwd=suite.directory,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                left = timeout - (time.perf_counter() - start)
                try:
                    process.wait(timeout=max(left, 0.0))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    notes.append(f"killed after the {timeout:.0f} s limit")
                    break
                if process.returncode >= 0 or len(crashes) >= MAX_CRASHES:
                    break
                # pytest died (XLA crashed, say): once more, past the tests begun.
                tests = [e for e in _entries(results) if e["event"] == "test"]
                begun = [e["nodeid"] for e in tests]
                finished = {e["nodeid"] for e in tests if e["when"] == "teardown"}
                in_progress = [n for n in begun if n not in finished]
                if not in_progress:
                    break
                crashes[in_progress[-1]] = _signal_name(process.returncode)
                done.write_text("\n".join(dict.fromkeys(begun)), encoding="utf-8")
                out.write(
                    f"\n[benchmarks/peers.py: pytest died "
                    f"({_signal_name(process.returncode)}) in {in_progress[-1]}; "
                    "resuming after it]\n\n".encode()
                )
    finally:
        # Interrupted or not: leave nothing running, and nothing behind.
        if process is not None and process.poll() is None:
            _terminate(process)
        written = _remove_new(suite.directory, before)
    wall, cpu = time.perf_counter() - start, _children_cpu() - start_cpu
    if written:
        shown = ", ".join(str(p.relative_to(suite.directory)) for p in written[:5])
        notes.append(f"removed what the run wrote into the checkout: {shown}")

    entries = _entries(results)
    outcomes, messages = _collate(entries)
    for nodeid, how in crashes.items():
        outcomes[nodeid] = "error"
        messages[nodeid] = f"pytest crashed ({how}) in this test"
        notes.append(f"pytest crashed ({how}) in `{nodeid}`; resumed after it")
    if process is not None and not timed_out and process.returncode < 0:
        notes.append(
            f"pytest crashed ({_signal_name(process.returncode)}), and the "
            f"run ended there (after {len(crashes)} resumptions)"
        )
    starts = [e for e in entries if e["event"] == "start"]
    ends = [e for e in entries if e["event"] == "end"]
    seen = starts[0]["filter_jit"] if starts else "?"
    if not starts:
        notes.append("the plugin did not start (see the log)")
    elif starts[0]["preimported"]:
        names = ", ".join(starts[0]["preimported"])
        notes.append(f"imported before the patch point: {names}")
    if starts and starts[0].get("swapped") is not None:
        swapped, left = starts[0]["swapped"], starts[0]["left"]
        notes.append(
            f"filterjit.patch_equinox() swapped {len(swapped)} Equinox wrappers "
            f"({', '.join(swapped) or 'none'}) and left {len(left)}"
            + (f" ({'; '.join(left)})" if left else "")
        )
    clears = [e for e in entries if e["event"] == "clear"]
    if clears:
        notes.append(
            f"JAX's caches cleared {len(clears)} times between tests, at more than "
            f"{clears[0]['limit']} memory maps"
        )
    if ends:
        wrapped = "; ".join(
            f"{library}: "
            + ", ".join(f"{n} {kind}" for kind, n in sorted(by_kind.items()))
            for library, by_kind in sorted(ends[-1].get("entry_points", {}).items())
        )
        if wrapped:
            notes.append(f"module-level jitted functions at the end: {wrapped}")
    name = TARGETS[target].seen
    swaps = [e["swaps"] for e in ends if "swaps" in e]  # one per process
    if swaps:
        made = sum(s["swapped"] for s in swaps)
        internal: dict[str, int] = {}
        for s in swaps:
            for module, n in s["internal"].items():
                internal[module] = internal.get(module, 0) + n
        # Each filterjit.jit makes a jax.jit of its own: not a call left to JAX.
        own = sum(n for m, n in internal.items() if m.split(".")[0] == "filterjit")
        internal = {m: n for m, n in internal.items() if m.split(".")[0] != "filterjit"}
        by_count = sorted(internal.items(), key=lambda item: -item[1])
        shown = ", ".join(f"{module} {n}" for module, n in by_count)
        notes.append(
            f"`jax.jit` calls from the suite's files, each making a `{seen}`: {made}; "
            f"calls left to `jax.jit` from elsewhere: {sum(internal.values())}"
            + (f" ({shown})" if shown else "")
            + f"; made by filterjit itself: {own}"
        )
    made = [e["made"] for e in ends if "made" in e]  # one per process
    counts: dict[str, int | None] = {}
    if made:
        counts = {
            library: None
            if any(m.get(library) is None for m in made)
            else sum(m[library] for m in made)
            for library in ("filterjit", "equinox")
        }
        notes.append(
            "`equinox.filter_jit` wrappers made during the run: "
            + ", ".join(
                f"{'n/a' if n is None else n} by {library}"
                for library, n in counts.items()
            )
            + (" (Equinox's left unswapped)" if patched else "")
        )
    if ends and ends[-1]["filter_jit"] != seen:
        notes.append(f"{name} was {ends[-1]['filter_jit']} at the end")
    if patched and starts and not seen.startswith("filterjit."):
        notes.append(f"not patched: {name} is {seen}")
    return Run(
        outcomes=outcomes,
        messages=messages,
        wall=wall,
        cpu=cpu,
        returncode=None if timed_out or process is None else process.returncode,
        timed_out=timed_out,
        filter_jit=seen,
        made=counts,
        notes=notes,
        log=log.read_text(encoding="utf-8", errors="replace"),
    )


def _cell(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text.replace("|", "\\|").replace("`", "'")


@dataclasses.dataclass(frozen=True)
class Round:
    """The tests that passed unpatched and not patched, run again alone, each way
    (`--check`)."""

    tests: tuple[str, ...]
    runs: dict[str, Run]


def lost_tests(runs: dict[str, Run]) -> list[str]:
    """The tests that pass unpatched and do not pass patched (or did not run)."""
    before, after = runs["unpatched"], runs["patched"]
    return sorted(
        n
        for n, o in before.outcomes.items()
        if o == "passed" and after.outcomes.get(n) != "passed"
    )


def run_checked(
    suite: Suite, target: str, workdir: Path, timeout: float, clear_caches: bool
) -> dict[str, Run]:
    """`--check`'s two runs: the suite patched, then unpatched only the tests that
    did not pass patched (those are the only ones a loss can be among)."""
    print(f"<!-- {suite.name}: patched run ... -->", flush=True)
    patched = run_suite(suite, target, True, workdir, timeout, clear_caches)
    asked = tuple(n for n, o in patched.outcomes.items() if o != "passed")
    only = f"run only on the {len(asked)} tests that did not pass patched (--check)"
    if asked:
        print(f"<!-- {suite.name}: unpatched run of {len(asked)} -->", flush=True)
        subset = Suite(suite.name, suite.directory, asked)
        unpatched = run_suite(subset, target, False, workdir, timeout, clear_caches)
        unpatched.notes.insert(0, only)
    else:
        unpatched = Run({}, {}, 0.0, 0.0, 0, False, "not run", {}, [only], "")
    return {"unpatched": unpatched, "patched": patched}


def run_again(
    suite: Suite,
    lost: list[str],
    target: str,
    workdir: Path,
    timeout: float,
    clear_caches: bool,
) -> list[Round]:
    """Runs the tests in `lost` again alone, unpatched then patched, up to `ROUNDS`
    times: each until it passes patched or fails unpatched (either way, not
    filterjit's doing), or has failed patched and passed unpatched every time."""
    rounds: list[Round] = []
    left = tuple(lost)
    while left and len(rounds) < ROUNDS:
        number = len(rounds) + 1
        print(
            f"<!-- {suite.name}: {len(left)} run again alone, round {number} -->",
            flush=True,
        )
        again = Suite(f"{suite.name}-again{number}", suite.directory, left)
        runs = {
            label: run_suite(
                again, target, label == "patched", workdir, timeout, clear_caches
            )
            for label in RUNS
        }
        rounds.append(Round(left, runs))
        left = tuple(
            n
            for n in left
            if runs["unpatched"].outcomes.get(n) == "passed"
            and runs["patched"].outcomes.get(n) != "passed"
        )
    return rounds


def check(suite: Suite, runs: dict[str, Run], rounds: list[Round]) -> tuple[bool, str]:
    """Whether the suite passes patched as it passes unpatched (`run_checked`'s
    runs), and one line that says so: no test that passes unpatched fails patched,
    in the suite and again alone in each of `rounds` (`run_again`), where it passed
    unpatched each time.
    A test that passes patched once alone, or fails alone unpatched too (a timing
    test under load, a test that needs the tests before it), is named, and not
    counted. Both runs ran, to the end, and the patched one with filterjit in
    place."""
    before, after = runs["unpatched"], runs["patched"]
    counts = "; ".join(
        f"{label}{where} {run.count('passed')} passed, {run.count('failed')} "
        f"failed, {run.count('error')} errors"
        for label, run, where in (
            ("patched", after, ""),
            ("unpatched", before, " (the tests that did not pass patched)"),
        )
    )
    problems = []
    asked = [n for n, o in after.outcomes.items() if o != "passed"]
    if not after.outcomes:
        problems.append("the patched run ran no test")
    if asked and not before.outcomes:
        problems.append("the unpatched run ran no test")
    for label, run in runs.items():
        if run.timed_out:
            problems.append(f"the {label} run timed out")
    if not after.filter_jit.startswith("filterjit."):
        problems.append(f"not patched: the patched run saw {after.filter_jit}")
    flaky, released_too, regressions = [], [], []
    for nodeid in lost_tests(runs):
        alone = [r.runs for r in rounds if nodeid in r.tests]
        if any(r["patched"].outcomes.get(nodeid) == "passed" for r in alone):
            flaky.append(nodeid)
        elif all(r["unpatched"].outcomes.get(nodeid) == "passed" for r in alone):
            regressions.append(nodeid)
        else:
            released_too.append(nodeid)
    if regressions:
        problems.append(
            f"passing unpatched, failing patched in the suite and alone: "
            f"{len(regressions)} ({', '.join(regressions)})"
        )
    line = f"{suite.name}: " + ("FAIL: " + "; ".join(problems) if problems else "PASS")
    line += f". {counts}"
    if flaky:
        line += (
            f"; {len(flaky)} failed patched in the suite and passed run again "
            f"alone ({', '.join(flaky)})"
        )
    if released_too:
        line += (
            f"; {len(released_too)} failed patched in the suite and failed run "
            f"again alone unpatched too ({', '.join(released_too)})"
        )
    return not problems, line + "."


def report(suite: Suite, runs: dict[str, Run], target: str) -> str:
    lines = [
        f"### {suite.name}",
        "",
        f"`cd {suite.directory} && python -m pytest {shlex.join(suite.args)}`",
        "",
        f"| run | `{TARGETS[target].seen}` is | passed | failed | errors | skipped "
        "| wall time | CPU time |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, run in runs.items():
        wall = f"{run.wall:.1f} s" + (" (timed out)" if run.timed_out else "")
        lines.append(
            f"| {label} | `{run.filter_jit}` | {run.count('passed')} "
            f"| {run.count('failed')} | {run.count('error')} "
            f"| {run.count('skipped')} | {wall} | {run.cpu:.1f} s |"
        )
    for label, run in runs.items():
        for note in run.notes:
            lines.append(f"\n{label}: {note}.")
        if not run.outcomes:
            tail = "\n".join(run.log.splitlines()[-15:])
            lines += ["", f"{label}: no test ran; the end of its log:", "", "```"]
            lines += [tail, "```"]
    if set(runs) == set(RUNS):
        before, after = runs["unpatched"], runs["patched"]
        lost = lost_tests(runs)
        gained = sorted(
            n
            for n, o in after.outcomes.items()
            if o == "passed" and before.outcomes.get(n) in ("failed", "error")
        )
        lines += ["", f"Pass unpatched, not patched: {len(lost)}."]
        if lost:
            lines += ["", "| test | patched | error (first line) |", "|---|---|---|"]
            for nodeid in lost:
                outcome = after.outcomes.get(nodeid, "not run")
                message = after.messages.get(nodeid, "")
                lines.append(
                    f"| `{_cell(nodeid, 200)}` | {outcome} | {_cell(message)} |"
                )
        if gained:
            lines += ["", f"Fail unpatched, pass patched: {len(gained)}.", ""]
            lines += [f"- `{nodeid}`" for nodeid in gained]
    return "\n".join(lines) + "\n"


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[Suite]]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Pytest arguments after `--` belong to the one DIRECTORY suite.",
    )
    parser.add_argument("directory", nargs="?", type=Path, help="a suite's checkout")
    parser.add_argument(
        "--suite",
        nargs=3,
        action="append",
        default=[],
        metavar=("NAME", "DIRECTORY", "ARGS"),
        help="a named suite; ARGS is one shell-quoted string of pytest arguments",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds each run (unpatched, patched) may take (default: 3600)",
    )
    parser.add_argument(
        "--target",
        choices=TARGETS,
        default="equinox",
        help="what filterjit goes in place of: equinox.filter_jit (default), or "
        "the test modules' jax.jit (filterjit.jit), for JAX's own tests",
    )
    parser.add_argument(
        "--only",
        choices=RUNS,
        help="make one of the two runs only",
    )
    parser.add_argument(
        "--rev",
        help="test filterjit as committed at this git revision (default: the "
        "working tree)",
    )
    parser.add_argument(
        "--no-clear",
        dest="clear",
        action="store_false",
        help="never clear JAX's caches between tests (by default they are cleared "
        "where the process nears the kernel's limit on memory maps, where XLA "
        "would crash)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="run the suite patched, then unpatched only where it did not pass "
        "patched; run each test that passes unpatched and not patched again alone, "
        "each way, up to three times; then print a line per suite, and exit 1 if "
        "one failed patched and passed unpatched each time (or the patched run "
        "ran no test, a run timed out, or was not patched)",
    )
    parser.add_argument("--json", type=Path, help="also write the outcomes here")
    parser.add_argument(
        "--keep", type=Path, help="keep each run's pytest log and results here"
    )
    argv = list(argv)
    rest: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, rest = argv[:split], argv[split + 1 :]
    args = parser.parse_args(argv)
    suites = [
        Suite(n, Path(d).resolve(), tuple(shlex.split(a))) for n, d, a in args.suite
    ]
    if args.directory is not None:
        directory = args.directory.resolve()
        suites.append(Suite(directory.name, directory, tuple(rest)))
    elif rest:
        parser.error("pytest arguments after `--` need a DIRECTORY")
    if not suites:
        parser.error("give a DIRECTORY or at least one --suite")
    for suite in suites:
        if not suite.directory.is_dir():
            parser.error(f"{suite.name}: {suite.directory} is not a directory")
    names = [suite.name for suite in suites]
    if len(set(names)) != len(names):
        parser.error("suite names must differ")
    return args, suites


def main(argv: Sequence[str] | None = None) -> int:
    args, suites = _parse(sys.argv[1:] if argv is None else argv)
    # Terminated (or interrupted), end the run in progress and remove the
    # temporary files on the way out. (A shell starts background jobs with SIGINT
    # ignored; SIGTERM is what reaches them.)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, _exit_on_signal)
    labels = [args.only] if args.only else list(RUNS)
    if args.check and args.only:
        raise SystemExit("peers.py: --check compares both runs; drop --only")
    everything: dict[str, dict[str, dict]] = {}
    verdicts: list[tuple[bool, str]] = []
    with tempfile.TemporaryDirectory(prefix="filterjit-peers-") as name:
        workdir = Path(name)
        plugin = workdir / "plugin"
        plugin.mkdir()
        shutil.copyfile(PLUGIN_SOURCE, plugin / f"{PLUGIN}.py")
        # filterjit from this checkout, whatever is installed: its working tree, or
        # a commit of it.
        if args.rev is None:
            (plugin / "filterjit").symlink_to(
                ROOT / "filterjit", target_is_directory=True
            )
            source = _describe("HEAD") + " and the working tree's changes, if any"
        else:
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", args.rev, "filterjit"],
                check=True,
                capture_output=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(plugin)], input=archive, check=True)
            source = _describe(args.rev)
        print(f"## filterjit in place of {TARGETS[args.target].replaced}\n")
        print(f"filterjit at {source}.\n")
        print(f"Python {sys.version.split()[0]}; {_versions()}.\n", flush=True)
        for suite in suites:
            if args.check:
                runs = run_checked(
                    suite, args.target, workdir, args.timeout, args.clear
                )
            else:
                runs = {}
                for label in labels:
                    print(f"<!-- {suite.name}: {label} run ... -->", flush=True)
                    runs[label] = run_suite(
                        suite,
                        args.target,
                        label == "patched",
                        workdir,
                        args.timeout,
                        args.clear,
                    )
            print(report(suite, runs, args.target), flush=True)
            rounds: list[Round] = []
            if args.check:
                lost = lost_tests(runs)
                if lost and not runs["patched"].timed_out:
                    rounds = run_again(
                        suite, lost, args.target, workdir, args.timeout, args.clear
                    )
                verdicts.append(check(suite, runs, rounds))
            everything[suite.name] = {
                label: {
                    "outcomes": run.outcomes,
                    "messages": run.messages,
                    "wall_s": run.wall,
                    "cpu_s": run.cpu,
                    "timed_out": run.timed_out,
                    "returncode": run.returncode,
                    "filter_jit": run.filter_jit,
                    "made": run.made,
                    "notes": run.notes,
                }
                for label, run in runs.items()
            }
            # After each suite, so that a long series stopped part-way keeps what
            # it finished.
            if args.json is not None:
                args.json.write_text(json.dumps(everything, indent=1), encoding="utf-8")
            if args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                names = [suite.name] + [
                    f"{suite.name}-again{i + 1}" for i in range(len(rounds))
                ]
                for name, label in itertools.product(names, runs):
                    run_dir = workdir / f"{name}-{label}"
                    for kept in ("pytest.log", "results.jsonl"):
                        if (run_dir / kept).exists():
                            shutil.copy(
                                run_dir / kept, args.keep / f"{run_dir.name}.{kept}"
                            )
    for _, line in verdicts:
        print(line)
    return 0 if all(passed for passed, _ in verdicts) else 1


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _describe(rev: str) -> str:
    """A revision of this checkout, as `abc1234 (committed 2026-01-31)`."""
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "log", "-1", "--format=%h (committed %cs)", rev],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return rev


def _versions() -> str:
    from importlib import metadata

    found = []
    for package in ("jax", "jaxlib", "equinox", "lineax", "optimistix", "diffrax"):
        try:
            found.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(found)


if __name__ == "__main__":
    sys.exit(main())
