"""The README's code runs as shown."""

import ast
import json
import pathlib
import re

import pytest
from test_docs import examples, run_block


README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_blocks_each_alone_print_what_is_shown():
    """Each `python` block of the README, copied alone into a script of its own,
    prints what its `Output` block shows (as `tests/test_docs.py` checks every page
    in the slow tier): the problem before and after, filterjit's entry points, and
    `patch_equinox()`."""
    blocks = examples(README.read_text())
    assert len(blocks) == 3
    outputs = []
    for block, shown in blocks:
        assert shown is not None, f"README.md, block at line {block.line}: no Output"
        printed = run_block(README, block)
        assert printed.strip() == shown.text.strip(), (block.line, printed)
        outputs.append(printed)
    rows = [line.split()[0] for line in outputs[0].splitlines()]
    assert rows == ["undecorated", "jax.jit", "equinox.filter_jit", "filter_jit"]
    assert "patch_equinox()" in blocks[-1][0].text


def test_readme_patch_equinox_block_fails_unpatched():
    """Without `patch_equinox()`, the README's example fails: it shows what the
    patch does."""
    import subprocess
    import sys

    code = examples(README.read_text())[-1][0].text
    unpatched = code.replace("filterjit.patch_equinox()", "pass")
    assert unpatched != code
    result = subprocess.run(
        [sys.executable, "-c", unpatched],
        cwd=README.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "Reverse-mode differentiation does not work" in result.stderr


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
    # Use: the three entry points and the demo, each shown.
    use = text.split("## Use", 1)[1].split("\n## ", 1)[0]
    for shown in ("@filter_jit", "@filterjit.jit", "filterjit.patch_equinox()"):
        assert shown in use, shown
    assert "```bash\npython -m filterjit\n```" in use
    # JAX for a GPU: one command, with filterjit, so that pip keeps JAX in range.
    assert '`python -m pip install . "jax[cuda13]"`' in install
    # No invented addresses: every link is a file of this repository or a real
    # page that the docs cite too.
    cited = "".join(page.read_text() for page in (README.parent / "docs").rglob("*.md"))
    for target in re.findall(r"\]\(([^)]+)\)", text):
        if target.startswith("https://"):
            assert target in cited, target
        else:
            assert (README.parent / target).exists(), target
    assert "<its URL>" not in text


def test_readme_is_a_short_pitch_and_contributing_holds_the_rest():
    """The README reads in two minutes, in a visitor's order: what filterjit is, the
    before and after with the contract's three places, install, use, the speed
    against `jax.jit` and `equinox.filter_jit`, how to develop and how long the
    tests take, links. How to develop, test and benchmark in full is in
    CONTRIBUTING.md."""
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    headings = re.findall(r"^## (.*)$", text, re.M)
    assert headings[:5] == [
        "Before and after",
        "Install",
        "Use",
        "Speed",
        "Develop and test",
    ], headings
    # One plain sentence first: what it is.
    first = text.split("\n\n")[1]
    assert first.startswith("filterjit ") and "equinox.filter_jit" in first
    # The contract in three places, one item each; NumPy values are traced at the
    # top level and under eager transforms, as `jax.jit` traces them.
    before_after = text.split("## Before and after", 1)[1].split("\n## ", 1)[0]
    places = [" ".join(item.split()) for item in before_after.split("\n- ")[1:]]
    assert [place.split("**")[1] for place in places] == [
        "At the top level",
        "Under eager transforms",
        "Inside a staged trace",
    ]
    assert "NumPy scalars and arrays are traced" in places[1]
    assert "keep the `jax.jit`" in places[1]  # the fix, as the error's note says
    # The speed, quoted from the recorded run (test_quoted_ratios_are_the_recorded
    # _runs checks each figure): filterjit's and Equinox's, as multiples of jax.jit.
    speed = text.split("## Speed", 1)[1].split("\n## ", 1)[0]
    assert "recorded" in speed and "jax.jit" in speed
    rows = [line for line in speed.splitlines() if line.startswith("| ")][1:]
    assert len(rows) >= 3
    for row in rows:
        assert len(re.findall(r"\d\.\d+×", row)) >= 2, row
    # Which training step each row is: a stateless one, a stateful one.
    steps = [row for row in rows if "training step" in row]
    assert steps and all(re.search(r"\bstate(less|ful) training", r) for r in steps)
    # How long the test command takes, and what it skips.
    develop_text = " ".join(text.split("## Develop and test", 1)[1].split())
    assert re.search(r"`python -m pytest` takes about \d+ minutes", develop_text)
    assert "skipped are the slow tier" in develop_text
    assert "`python -m pytest --full`" in develop_text
    # Contributor material is in CONTRIBUTING.md, which the README links.
    contributing = README.parent / "CONTRIBUTING.md"
    assert "(CONTRIBUTING.md)" in text
    guide = contributing.read_text()
    for detail in ("FILTERJIT_FASTPATH=0", "benchmarks/run.py --record"):
        assert detail not in text, detail
    for detail in (
        "FILTERJIT_FASTPATH=0 python -m pytest",
        "python -m pytest --full",
        "python benchmarks/run.py --plot docs/performance.svg --record",
        "python tests/test_docs.py docs/page.md --update",
    ):
        assert detail in guide, detail
    bash = re.compile(r"```bash\n(.*?)```", re.S)
    develop = text.split("## Develop and test", 1)[1]
    assert bash.findall(develop)[0] == bash.findall(guide)[0]
    for target in re.findall(r"\]\(([^)]+)\)", guide):
        assert (README.parent / target).exists(), target


def test_the_documented_docs_commands_show_no_end_of_life_banner():
    """Every `mkdocs` command the README and CONTRIBUTING.md give sets
    NO_MKDOCS_2_WARNING, without which Material for MkDocs prints its end-of-life
    banner first."""
    for page in (README, README.parent / "CONTRIBUTING.md"):
        commands = re.findall(
            r"^.*\bmkdocs (?:build|serve)\b.*$", page.read_text(), re.M
        )
        assert commands, page.name
        for command in commands:
            assert "NO_MKDOCS_2_WARNING=1 mkdocs " in command, (page.name, command)


def test_readme_states_version_license_and_supported_versions():
    """The README's facts line says what pyproject.toml and the package say."""
    import tomllib

    import filterjit

    text = README.read_text()
    facts = text.split("\n## ", 1)[0]
    project = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]
    assert f"filterjit {filterjit.__version__}" in facts
    assert project["license"] in facts
    assert "Python 3.11 to 3.13" in facts
    (jax,) = [d for d in project["dependencies"] if d.startswith("jax>")]
    assert f"`{jax}`" in facts
    assert "JAX 0.9.2\nto 0.12.x" in facts


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
    """CI runs the floor, Python 3.12 and newest legs beside the main one, and each
    leg runs the README's test command; the equinox leg beside them."""
    commands = _ci_commands()
    matrix_legs = ".ci/matrix --parallel floor py312 newest equinox"
    assert matrix_legs in commands
    assert commands.index(matrix_legs) > commands.index("python -m pytest --full")
    matrix = (README.parent / ".ci" / "matrix").read_text()
    matrix_commands = [line.split("#")[0].strip() for line in matrix.splitlines()]
    assert "python -m pytest" in matrix_commands
    assert ".ci/equinox" in matrix_commands


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
    # requires-python allows exactly the versions the classifiers name.
    from packaging.specifiers import SpecifierSet

    requires = SpecifierSet(project["requires-python"])
    allowed = [f"3.{minor}" for minor in range(8, 16) if f"3.{minor}" in requires]
    assert allowed == pythons, project["requires-python"]


def test_changelog_has_a_released_section_for_this_version():
    """Keep a Changelog's form: `## [VERSION] - DATE` per release, the newest
    first and this version, under it only Keep a Changelog's kinds of change."""
    import filterjit

    changelog = (README.parent / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(\S+)\] - (\d{4}-\d{2}-\d{2})$", changelog, re.M)
    assert releases, "no released section"
    assert releases[0][0] == filterjit.__version__
    assert "## [Unreleased]" not in changelog
    assert re.findall(r"^## .*$", changelog, re.M) == [
        f"## [{version}] - {date}" for version, date in releases
    ]
    kinds = set(re.findall(r"^### (.*)$", changelog, re.M))
    assert kinds <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def _user_pages() -> list[pathlib.Path]:
    docs = sorted((README.parent / "docs").rglob("*.md"))
    return [README, README.parent / "CHANGELOG.md", *docs]


def test_user_pages_tell_no_history():
    """README, CHANGELOG and the docs speak of filterjit as it is: no commit named
    (the recorded benchmark run names its own, in `benchmarks/results.md`), no
    issue numbers, no sessions of work; the CHANGELOG names no private module."""
    commit = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
    history = re.compile(r"\bissues? \d+|\bsessions?\b|\bround \d+", re.I)
    for page in _user_pages():
        text = page.read_text()
        assert not commit.findall(text), (page.name, commit.findall(text))
        assert not history.findall(text), (page.name, history.findall(text))
    changelog = (README.parent / "CHANGELOG.md").read_text()
    internal = re.compile(r"\b_\w+\.py\b|\bDispatcher\b|tests/|benchmarks/")
    assert not internal.findall(changelog), internal.findall(changelog)


def _rendered_text(page: pathlib.Path) -> str:
    """The text of a built page's article, tags removed."""
    import html

    article = re.search(r"<article.*?</article>", page.read_text(), re.S)
    assert article, page
    text = re.sub(r"<(p|div|h\d|li|tr|pre)\b[^>]*>", "\n", article.group(0))
    return html.unescape(re.sub(r"<[^>]+>", "", text))


def _top_level_items(text: str) -> list[str]:
    """The comma-separated items of `text` up to its first unmatched `)`, then what
    follows: `a: dict[str, int], b) -> int` gives `a: dict[str, int]`, `b` and
    `-> int`."""
    items, depth, current = [], 0, ""
    for index, char in enumerate(text):
        depth += 1 if char in "[(" else -1 if char in "])" else 0
        if depth < 0:
            items.append(current)
            return [item.strip() for item in items if item.strip()] + [
                text[index + 1 :].strip()
            ]
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    raise AssertionError(f"no closing parenthesis: {text}")


def test_api_pages_render_for_users(tmp_path):
    """The built API pages show what a user calls: signatures with types and no
    type variables (`_P`, `_R`, `_T`), no unexported type (`DonateOption`), no
    private name, no `x = x` attribute values, no implementation details of the
    wrappers (`__dict__`, `_fun`); and each "Raises" names the exception type."""
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
    pages = sorted((README.parent / "docs" / "api").glob("*.md"))
    assert len(pages) >= 6
    private = re.compile(r"(?<![\w.])_{1,2}[A-Za-z]\w*")
    for page in pages:
        built = site / "api" / page.stem / "index.html"
        rendered = built.read_text()
        signatures = [
            html.unescape(re.sub(r"<[^>]+>", "", block))
            for block in re.findall(
                r'<div class="doc-signature.*?</div>', rendered, re.S
            )
        ]
        for signature in signatures:
            assert not private.search(signature), (page.name, signature)
            assert "DonateOption" not in signature, (page.name, signature)
            if "(" not in signature:  # an attribute: `name: type`
                assert re.fullmatch(r"\s*\w+: .+", signature, re.S), signature
                continue
            # Parameters have types: `name: type`, or `*args`/`**kwargs`.
            inside = signature.split("(", 1)[1]
            for parameter in _top_level_items(inside)[:-1]:
                assert (
                    parameter in ("*", "/")
                    or ":" in parameter
                    or (parameter.startswith("*"))
                ), (page.name, signature)
        text = _rendered_text(built)
        assert not re.search(r"^(\w+) = \1$", text, re.M), page.name
        for internal in (
            "__dict__",
            "_fun",
            "_jit_info",
            "_cache_size",
            "__getstate__",
        ):
            assert internal not in text, (page.name, internal)
        assert not re.search(r"\b_[PRT]\b", text), page.name
        # "Raises" names the exception: `ValueError`, `TypeError`, ...
        for sentence in re.findall(r"Raises\b[^.]*", text):
            if page.stem == "export":
                continue  # the export pages are written apart
            assert re.search(r"\w+(Error|Exception|Warning)\b", sentence) or (
                sentence.strip() in ("Raises:", "Raises (when called):")
            ), (page.name, sentence)
    # The signatures the pages quote: filter_jit's, with its parameters' types.
    text = _rendered_text(site / "api" / "filter_jit" / "index.html")
    assert "donate: str | tuple[str, ...] = " in text
    assert "fun: Callable | None = None" in text


RESULTS = README.parent / "benchmarks" / "results.md"
# The TPU run, quoted under its own heading of docs/performance.md alone.
RESULTS_TPU = README.parent / "benchmarks" / "results-tpu.md"
TPU_HEADING = "### On a TPU\n"


def _pages() -> list[pathlib.Path]:
    # docs/jax-jit.md quotes its own measurements of `filterjit.jit`, with the
    # run they come from.
    docs = sorted((README.parent / "docs").rglob("*.md"))
    return [README, *(page for page in docs if page.name != "jax-jit.md")]


def _recorded_figures(results: pathlib.Path) -> set[str]:
    """The figures of the recorded run `results` (its table cells and its `1.08×`s),
    after checking that it names its commit and is a full run."""
    recorded = results.read_text()
    figures = json.loads(results.with_suffix(".json").read_text())
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
    return cells | set(re.findall(r"(\d+\.\d+)×", recorded))


def _quoted_ratios(text: str) -> list[str]:
    # Targets (`≤ 1.5 ×`) are not figures of a run.
    quotes = re.findall(r"(?<!≤ )(?<![\d.])(\d+\.\d+)(?:–(\d+\.\d+))? ?×", text)
    return [figure for pair in quotes for figure in pair if figure]


def test_quoted_ratios_are_the_recorded_runs():
    """Every ratio the README and the docs quote (`1.08×`, `0.87–0.92×`) is one of
    the recorded CPU run's, or under docs/performance.md's TPU heading the TPU
    run's; each run names its commit and is a full run."""
    cells = _recorded_figures(RESULTS)
    tpu_cells = _recorded_figures(RESULTS_TPU)
    quoted = 0
    for page in _pages():
        text, tpu_text = page.read_text(), ""
        if page.name == "performance.md":
            before, tpu_text = text.split(TPU_HEADING, 1)
            tpu_text, after = tpu_text.split("\n### ", 1)
            text = before + after
            assert _quoted_ratios(tpu_text)
        for figure in _quoted_ratios(text):
            assert figure in cells, f"{page.name}: {figure}× is not the run's"
            quoted += 1
        for figure in _quoted_ratios(tpu_text):
            assert figure in tpu_cells, f"{page.name}: {figure}× is not the TPU run's"
    assert quoted >= 3
    # The page shows each run with its header, which names the commit.
    performance = (README.parent / "docs" / "performance.md").read_text()
    assert '--8<-- "benchmarks/results.md"' in performance
    assert '--8<-- "benchmarks/results-tpu.md"' in performance


def test_the_chart_is_the_recorded_run():
    import xml.etree.ElementTree as ET

    SVG = "{http://www.w3.org/2000/svg}"
    figures = json.loads(RESULTS.with_suffix(".json").read_text())
    svg = ET.parse(README.parent / "docs" / "performance.svg").getroot()
    texts = " ".join("".join(t.itertext()) for t in svg.iter(f"{SVG}text"))
    assert f"(commit {figures['commit']})" in texts
    assert figures["date"] in texts
    # The charted sections' rows (`CHARTED` in the benchmark; the others are
    # tabled only).
    run = ast.parse((README.parent / "benchmarks" / "run.py").read_text())
    (charted,) = [
        ast.literal_eval(node.value)
        for node in run.body
        if isinstance(node, ast.Assign)
        and [ast.unparse(target) for target in node.targets] == ["CHARTED"]
    ]
    recorded = {
        (row["label"], name): ratio
        for section, rows in figures["ratios"].items()
        if section in charted
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
