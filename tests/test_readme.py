"""The README's code runs as shown."""

import json
import pathlib
import re

import pytest


README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_code_blocks(capsys):
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 3
    namespace: dict = {}
    # The first block is the problem, before and after: it prints what is shown.
    exec(blocks[0], namespace)
    shown = re.search(r"```python\n.*?```\n\n```text\n(.*?)```", text, re.S)
    assert shown is not None
    assert capsys.readouterr().out == shown[1]
    for block in blocks[1:]:
        exec(block, namespace)
    assert namespace["filterjit"].num_traces(namespace["step"]) == 1
    info = namespace["info"]
    assert info == {"steps": 2}
    jax = namespace["jax"]
    assert namespace["power"](2.0, 3) == 8.0
    assert jax.jit(jax.grad(lambda x: namespace["power"](x, 3)))(2.0) == 12.0


def test_readme_says_how_to_install_to_use_and_to_develop():
    text = README.read_text()
    install = text.split("## Install", 1)[1].split("\n## ", 1)[0]
    bash = re.compile(r"```bash\n(.*?)```", re.S)
    (commands,) = bash.findall(install)
    # To use it: a fresh virtualenv and the package alone, from the checkout.
    assert commands.splitlines() == [
        "python3 -m venv .venv",
        ". .venv/bin/activate",
        "python -m pip install .",
    ]
    develop = text.split("## Develop and test", 1)[1]
    assert bash.findall(develop)[0].splitlines() == [
        'python -m pip install -e ".[test]"',
        "python -m filterjit",
        "python -m pytest",
    ]
    # No invented addresses: every link is a file of this repository or a real
    # page that the docs cite too.
    for target in re.findall(r"\]\(([^)]+)\)", text):
        if target.startswith("https://"):
            assert target in (README.parent / "docs" / "index.md").read_text()
        else:
            assert (README.parent / target).exists(), target
    assert "<its URL>" not in text


def _ci_commands() -> list[str]:
    """The commands of `.ci/run`, each without its comment and without the `step`
    that times it."""
    ci = (README.parent / ".ci" / "run").read_text()
    commands = [line.split("#")[0].strip() for line in ci.splitlines()]
    return [command.removeprefix("step ") for command in commands]


def test_ci_runs_the_readme_commands():
    """CI installs as the README says before anything else, and runs its demo and
    its test command (with the slow tier)."""
    commands = _ci_commands()
    installs = [c for c in commands if "pip install" in c]
    assert installs[0] == 'python -m pip install -e ".[test]"', installs
    assert 'python -m pip install -e ".[test,dev,docs,bench]"' in installs
    assert "python -m filterjit" in commands
    assert "python -m pytest --full" in commands


def test_install_is_the_one_in_getting_started():
    getting_started = (README.parent / "docs" / "getting-started.md").read_text()
    bash = re.compile(r"```bash\n(.*?)```", re.S)
    readme_install = README.read_text().split("## Install", 1)[1]
    install = getting_started.split("## Install", 1)[1]
    assert bash.findall(readme_install)[0] == bash.findall(install)[0]
    develop = README.read_text().split("## Develop and test", 1)[1]
    assert bash.findall(develop)[0] in getting_started


def test_ci_runs_the_matrix():
    """CI runs the floor and newest legs after the main one, and each leg runs the
    README's test command."""
    commands = _ci_commands()
    matrix_legs = ".ci/matrix --parallel floor newest"
    assert matrix_legs in commands
    assert commands.index(matrix_legs) > commands.index("python -m pytest --full")
    matrix = (README.parent / ".ci" / "matrix").read_text()
    matrix_commands = [line.split("#")[0].strip() for line in matrix.splitlines()]
    assert "python -m pytest" in matrix_commands


def test_floor_leg_pins_the_lower_bounds():
    """`.ci/floor.txt` pins every runtime dependency at its lower bound in
    pyproject.toml: the floor leg tests what the bounds promise."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    pyproject = tomllib.loads((README.parent / "pyproject.toml").read_text())
    floors = {}
    for dependency in pyproject["project"]["dependencies"]:
        requirement = Requirement(dependency)
        lower = [s.version for s in requirement.specifier if s.operator == ">="]
        assert len(lower) == 1, dependency
        floors[requirement.name] = Version(lower[0])
    pins = {}
    for line in (README.parent / ".ci" / "floor.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name] = Version(version)
    assert pins == floors


def test_one_version_source_and_classifiers():
    """The version is written once, in `filterjit/__init__.py`, which hatchling
    reads; the classifiers name the Python versions CI tests, and the types."""
    import tomllib

    import filterjit

    pyproject = tomllib.loads((README.parent / "pyproject.toml").read_text())
    project = pyproject["project"]
    assert "version" not in project
    assert project["dynamic"] == ["version"]
    source = pyproject["tool"]["hatch"]["version"]["path"]
    assert source == "filterjit/__init__.py"
    assert re.findall(
        r'^__version__ = "(.*?)"', (README.parent / source).read_text(), re.M
    ) == [filterjit.__version__]
    classifiers = project["classifiers"]
    assert "Typing :: Typed" in classifiers
    assert (README.parent / "filterjit" / "py.typed").exists()
    pythons = [c.rsplit(" ", 1)[1] for c in classifiers if re.search(r":: 3\.\d+$", c)]
    assert pythons == ["3.11", "3.12", "3.13"]
    assert project["requires-python"] == ">=3.11"


def test_changelog_has_a_released_section_for_this_version():
    import filterjit

    changelog = (README.parent / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## (\S+) \((\d{4}-\d{2}-\d{2})\)$", changelog, re.M)
    assert releases, "no released section"
    assert releases[0][0] == filterjit.__version__
    assert "## Unreleased" not in changelog


def test_api_signatures_are_readable(tmp_path):
    """The API pages' signatures show no private type variables (`_P`, `_R`) and
    no unexported type (`DonateOption`)."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    import html
    import os
    import subprocess
    import sys

    site = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--no-strict", "-q", "-d", site],
        cwd=README.parent,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    # The pages of filter_jit, the diagnostics and the AOT objects (`jit`'s page
    # is checked where its signature is written).
    for page in ("filter_jit", "diagnostics", "aot"):
        rendered = (site / "api" / page / "index.html").read_text()
        signatures = [
            html.unescape(re.sub(r"<[^>]+>", "", block))
            for block in re.findall(
                r'<div class="doc-signature.*?</div>', rendered, re.S
            )
        ]
        assert signatures, page
        for signature in signatures:
            assert not re.search(r"\b_[A-Z]\b|DonateOption", signature), signature
    rendered = (site / "api" / "filter_jit" / "index.html").read_text()
    assert "DonateOption" not in html.unescape(re.sub(r"<[^>]+>", "", rendered))


RESULTS = README.parent / "benchmarks" / "results.md"


def _pages() -> list[pathlib.Path]:
    # docs/jax-jit.md quotes its own measurements of `filterjit.jit`, with the
    # run they come from.
    docs = sorted((README.parent / "docs").rglob("*.md"))
    return [README, *(page for page in docs if page.name != "jax-jit.md")]


def test_quoted_ratios_are_the_recorded_runs():
    """Every ratio the README and the docs quote (`1.08×`, `0.87–0.92×`) is one of
    the recorded run's, which names its commit and is a full run."""
    recorded = RESULTS.read_text()
    figures = json.loads(RESULTS.with_suffix(".json").read_text())
    commit = figures["commit"]
    assert re.fullmatch(r"[0-9a-f]{7,}", commit), commit  # no uncommitted change
    assert f"at commit {commit}." in recorded
    assert figures["environment"].startswith("Mode: full.")
    assert figures["command"].startswith("python benchmarks/run.py")
    assert "--quick" not in figures["command"]
    cells = {
        cell.strip().rstrip("×")
        for line in recorded.splitlines()
        if line.startswith("|")
        for cell in line.split("|")
    }
    cells |= set(re.findall(r"(\d+\.\d+)×", recorded))
    quoted = 0
    for page in _pages():
        text = page.read_text()
        # Targets (`≤ 1.5 ×`) are not figures of a run.
        quotes = re.findall(r"(?<!≤ )(?<![\d.])(\d+\.\d+)(?:–(\d+\.\d+))? ?×", text)
        for low, high in quotes:
            for figure in filter(None, (low, high)):
                assert figure in cells, f"{page.name}: {figure}× is not the run's"
                quoted += 1
    assert quoted >= 3
    performance = (README.parent / "docs" / "performance.md").read_text()
    assert '--8<-- "benchmarks/results.md"' in performance
    assert f"The recorded run is of commit {commit}," in performance


def test_the_chart_is_the_recorded_run():
    import xml.etree.ElementTree as ET

    SVG = "{http://www.w3.org/2000/svg}"
    figures = json.loads(RESULTS.with_suffix(".json").read_text())
    svg = ET.parse(README.parent / "docs" / "performance.svg").getroot()
    texts = " ".join("".join(t.itertext()) for t in svg.iter(f"{SVG}text"))
    assert f"(commit {figures['commit']})" in texts
    assert figures["date"] in texts
    recorded = {
        (row["label"], name): ratio
        for rows in figures["ratios"].values()
        for row in rows
        for name, ratio in row["ratios"].items()
    }
    bars = {
        (rect.attrib["data-row"], rect.attrib["data-implementation"]): float(
            rect.attrib["data-ratio"]
        )
        for rect in svg.iter(f"{SVG}rect")
        if rect.get("class") == "bar"
    }
    assert bars and bars == recorded
    assert any(name == "filterjit.jit" for _, name in bars)
