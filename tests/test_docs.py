"""The documentation: every public name has an API entry, and every code example
in the pages runs and prints what the page says it prints.

Conventions in `README.md` and `docs/**/*.md`:

- A ```` ```python ```` block is run alone: its text as a script of its own, in
  a fresh Python process, in an empty folder (the way a reader copies one block).
  So each block holds its imports and its setup; one that imports a package
  filterjit does not install says so in its first line
  (`# needs diffrax: pip install diffrax`).
- A ```` ```text title="Output" ```` block right after a `python` block is what that
  block prints (stdout and stderr); it is compared exactly, trailing spaces aside.
  A block with none prints nothing.
- A ```` ```py ```` block is shown but not run: a fragment, or a signature.

Running every block takes a while, so that test is in the slow tier
(`python -m pytest --full`). `python tests/test_docs.py docs/page.md` prints what
each block of a page prints, run alone; add `--update` to write that into the
page's `Output` blocks (when every block of the page ran).
"""

import ast
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from helpers import BACKEND_START_UP_WARNINGS, subprocess_env


ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
API = DOCS / "api"
OUTPUT_INFO = 'text title="Output"'
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>.*)$")


class Block(NamedTuple):
    info: str
    text: str
    line: int  # 1-based line of the opening fence
    end: int  # 1-based line of the closing fence


def fenced_blocks(markdown: str) -> list[Block]:
    """Every fenced code block of a markdown page, dedented to its fence."""
    lines = markdown.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        indent, fence = match["indent"], match["fence"]
        closing = re.compile(rf"^{re.escape(indent)}{re.escape(fence)}[ \t]*$")
        j = i + 1
        while j < len(lines) and not closing.match(lines[j]):
            j += 1
        body = [line[len(indent) :] for line in lines[i + 1 : j]]
        blocks.append(Block(match["info"].strip(), "\n".join(body), i + 1, j + 1))
        i = j + 1
    return blocks


def examples(markdown: str) -> list[tuple[Block, Block | None]]:
    """The `python` blocks of a page, each with the `Output` block that follows it
    (nothing but blank lines between), or `None`."""
    lines = markdown.splitlines()
    blocks = fenced_blocks(markdown)
    pairs = []
    for index, block in enumerate(blocks):
        if block.info.split(" ")[0] != "python":
            continue
        output = None
        if index + 1 < len(blocks):
            following = blocks[index + 1]
            between = lines[block.end : following.line - 1]
            if following.info == OUTPUT_INFO and not any(s.strip() for s in between):
                output = following
        pairs.append((block, output))
    return pairs


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def _block_env() -> dict[str, str]:
    env = subprocess_env()
    for name in ("FILTERJIT_EXPLAIN_RETRACES", "FILTERJIT_RETRACE_WARNING_THRESHOLD"):
        env.pop(name, None)
    env["PYTHONUNBUFFERED"] = "1"  # stdout and stderr in the order they were written
    # What a block prints is compared: a TPU machine's start-up warning is not.
    env["PYTHONWARNINGS"] = BACKEND_START_UP_WARNINGS
    return env


def run_block(path: Path, block: Block) -> str:
    """Runs one `python` block alone, as a reader who copies it would: its text as
    a script of its own, in a fresh interpreter, in an empty folder. Returns what
    it printed (stdout and stderr together)."""
    shown = _shown(path)
    name = path.stem if shown.is_absolute() else "-".join(shown.with_suffix("").parts)
    with tempfile.TemporaryDirectory(prefix="filterjit-docs-") as folder:
        script = Path(folder) / f"{name}-line{block.line}.py"
        script.write_text(block.text + "\n", encoding="utf-8")
        result = subprocess.run(
            [sys.executable, script.name],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=folder,
            env=_block_env(),
            timeout=600,
        )
    if result.returncode != 0:
        raise AssertionError(
            f"{_shown(path)}, block at line {block.line} fails when run "
            f"alone:\n{result.stdout[-6000:]}"
        )
    return result.stdout


def run_page(path: Path, workers: int = 1) -> list[str]:
    """What each `python` block of a page prints, each run alone."""
    blocks = [block for block, _ in examples(path.read_text(encoding="utf-8"))]
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda block: run_block(path, block), blocks))


def _shown(path: Path) -> Path:
    """`path` as a message shows it: from the repository's root where it is in it."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def pages_with_examples() -> list[Path]:
    """The README and every page of `docs/` with a `python` block."""
    return [
        path
        for path in [README, *sorted(DOCS.rglob("*.md"))]
        if examples(path.read_text(encoding="utf-8"))
    ]


# -- Tests


def public_names() -> list[str]:
    """The names `filterjit/__init__.py` re-exports (`from ._x import y as y`)."""
    tree = ast.parse((ROOT / "filterjit" / "__init__.py").read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names += [a.asname for a in node.names if a.asname == a.name]
    return names


def documented_names() -> set[str]:
    """Names with a `::: filterjit.NAME` entry in the API pages."""
    found = set()
    for page in API.glob("*.md"):
        found.update(re.findall(r"^:::\s*filterjit\.(\w+)\s*$", page.read_text(), re.M))
    return found


def test_every_public_name_is_in_the_api_reference():
    import filterjit

    names = public_names()
    assert "filter_jit" in names and "explain" in names
    at_runtime = {
        name
        for name in dir(filterjit)
        if not name.startswith("_")
        and not type(getattr(filterjit, name)).__name__ == "module"
    }
    assert set(names) == at_runtime
    missing = sorted(set(names) - documented_names())
    assert not missing, f"not in docs/api/*.md as `::: filterjit.NAME`: {missing}"


def test_every_api_page_is_in_the_nav():
    config = (ROOT / "mkdocs.yml").read_text()
    for page in [*API.glob("*.md"), *DOCS.glob("*.md"), *DOCS.glob("how-to/*.md")]:
        assert str(page.relative_to(DOCS)) in config, page


def test_module_names_in_the_pages_exist():
    """A page that names filterjit's code (`_trace.level_reader`,
    `Dispatcher.call`) names what is there."""
    import importlib

    for page in DOCS.rglob("*.md"):
        text = page.read_text(encoding="utf-8")
        for module, name in re.findall(r"`(_[a-z]+)\.([A-Za-z_]\w*)", text):
            if name == "py":
                assert (ROOT / "filterjit" / f"{module}.py").exists(), module
                continue
            imported = importlib.import_module(f"filterjit.{module}")
            assert hasattr(imported, name), f"{page.name}: {module}.{name}"


def test_an_article_fits_the_name_it_introduces():
    """A `filterjit.EquinoxPatch`, an `eqx.Module`: in the pages and in the
    docstrings the API pages render, "an" comes before a name that starts with
    a, e, i or o, "a" before one that starts with a consonant (`n`, `u` and `x`
    read either way: "a `None`", "an `nnx.Module`")."""
    article = re.compile(r"\b([Aa]n?) \[?`([A-Za-z])")
    sources = [README, *DOCS.rglob("*.md"), *(ROOT / "filterjit").glob("*.py")]
    wrong = []
    for source in sources:
        for number, line in enumerate(source.read_text().splitlines(), 1):
            for word, letter in article.findall(line):
                if letter.lower() in "nux":
                    continue
                if (word.lower() == "an") != (letter.lower() in "aeio"):
                    wrong.append(f"{source.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not wrong, "\n".join(wrong)


def test_navigation():
    """Users' pages first; the pages for contributors in a section of their own;
    the examples page lists every example; libraries.md says how to install the
    libraries it runs; and what a block prints wraps its long lines."""
    config = (ROOT / "mkdocs.yml").read_text()
    nav = config.split("\nnav:\n", 1)[1]
    contributing = nav.split("  - Contributing:\n", 1)[1]
    for page in ("internals.md", "call-flow.md"):
        assert page in contributing and nav.count(page) == 1, page
    shown = re.findall(r"^## (\w+\.py)$", (DOCS / "examples.md").read_text(), re.M)
    assert sorted(shown) == sorted(p.name for p in (ROOT / "examples").glob("*.py"))
    libraries = (DOCS / "libraries.md").read_text()
    assert "```bash\npip install diffrax optimistix lineax\n```" in libraries
    assert "  - stylesheets/extra.css" in config
    css = (DOCS / "stylesheets" / "extra.css").read_text()
    assert "white-space: pre-wrap" in css


def test_fenced_block_parser():
    page = (
        'text\n```python\nprint(1)\n```\n\n```text title="Output"\n1\n```\n'
        "    ```python\n    x = 2\n    ```\n```py\nnot run\n```\n"
    )
    pairs = examples(page)
    assert [(b.text, o and o.text) for b, o in pairs] == [
        ("print(1)", "1"),
        ("x = 2", None),
    ]


def test_pages_have_examples():
    pages = {str(p.relative_to(ROOT)) for p in pages_with_examples()}
    assert {"docs/index.md", "docs/getting-started.md", "README.md"} <= pages


_outputs: dict[tuple[Path, int], "concurrent.futures.Future[str]"] = {}


def block_output(page: Path, block: Block) -> str:
    """What `block` of `page` prints, run alone. The first call starts every block
    of every page, one process each, over the CPUs, so that they run in parallel."""
    if not _outputs:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2)
        for path in pages_with_examples():
            for each, _ in examples(path.read_text(encoding="utf-8")):
                _outputs[path, each.line] = pool.submit(run_block, path, each)
        pool.shutdown(wait=False)
    return _outputs[page, block.line].result()


def _all_blocks() -> list[tuple[Path, Block, Block | None]]:
    return [
        (page, block, shown)
        for page in pages_with_examples()
        for block, shown in examples(page.read_text(encoding="utf-8"))
    ]


def pytest_generate_tests(metafunc: Any) -> None:
    if "page_block" in metafunc.fixturenames:
        found = _all_blocks()
        ids = [f"{page.relative_to(ROOT)}:{block.line}" for page, block, _ in found]
        metafunc.parametrize("page_block", found, ids=ids)


def test_the_readme_and_every_page_are_checked_each_block_alone(tmp_path: Path):
    """Every page with a `python` block is checked, the README too, none exempted;
    and a block that uses what the block above it made fails the check."""
    with_python = [
        page
        for page in [README, *DOCS.rglob("*.md")]
        if "\n```python\n" in page.read_text(encoding="utf-8")
    ]
    assert sorted(pages_with_examples()) == sorted(with_python)
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nprint(x + 1)\n```\n")
    first, second = [block for block, _ in examples(page.read_text())]
    assert run_block(page, first) == ""
    with pytest.raises(AssertionError, match="block at line 5 fails when run alone"):
        run_block(page, second)


def _dependencies() -> set[str]:
    """The modules filterjit's installation brings: its dependencies, the standard
    library and filterjit."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {Requirement(d).name for d in project["dependencies"]}
    return names | set(sys.stdlib_module_names) | {"filterjit"}


def test_a_block_that_needs_another_package_says_so_first():
    """A block copied alone into an environment with filterjit alone says in its
    first line what else it needs: `# needs diffrax: pip install diffrax`."""
    installed = _dependencies()
    for page, block, _ in _all_blocks():
        imported = set()
        for node in ast.walk(ast.parse(block.text)):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
        needed = sorted(imported - installed)
        first = block.text.split("\n", 1)[0]
        installs = first.partition(": pip install ")[2].split()
        said = first.startswith("# needs ") and set(needed) <= set(installs)
        assert not needed or said, (
            f"{page.relative_to(ROOT)}, block at line {block.line} imports {needed}, "
            "which filterjit does not install: its first line says so, as "
            f"`# needs {', '.join(needed)}: pip install {' '.join(needed)}`"
        )


def test_blocks_import_what_they_use():
    """Each block is a script of its own: it imports every module it names (a
    quick check of what the slow test below finds by running the blocks)."""
    modules = {"jax", "jnp", "np", "eqx", "lax", "filterjit", "optax", "jtu"}
    for page, block, _ in _all_blocks():
        tree = ast.parse(block.text)
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
        used = {
            node.value.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        }
        missing = sorted((used & modules) - imported)
        assert not missing, (
            f"{page.relative_to(ROOT)}, block at line {block.line} uses {missing} "
            "without importing them: each block must run when copied alone"
        )


@pytest.mark.slow  # every block in a process of its own: minutes on 2 CPUs
def test_each_block_alone_prints_what_the_page_shows(
    page_block: tuple[Path, Block, Block | None],
):
    page, block, shown = page_block
    printed = block_output(page, block)
    expected = "" if shown is None else shown.text
    assert _normalise(printed) == _normalise(expected), (
        f"{page.relative_to(ROOT)}, block at line {block.line}, run alone, "
        f"prints\n{printed}\nbut the page shows\n{expected or '(no Output block)'}"
    )


# -- Command line


def _update(path: Path, outputs: list[str]) -> None:
    lines = path.read_text().splitlines()
    pairs = examples(path.read_text())
    # From the end, so that earlier line numbers stay valid.
    for (block, shown), printed in reversed(list(zip(pairs, outputs))):
        indent = re.match(r"[ \t]*", lines[block.end - 1])
        pad = indent.group(0) if indent else ""
        new = [pad + line if line else line for line in _normalise(printed).split("\n")]
        if shown is not None:
            lines[shown.line : shown.end - 1] = new
        elif printed.strip():
            lines[block.end : block.end] = [
                "",
                f"{pad}```{OUTPUT_INFO}",
                *new,
                f"{pad}```",
            ]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    args = sys.argv[1:]
    update = "--update" in args
    for name in [a for a in args if a != "--update"]:
        path = Path(name).resolve()
        blocks = [block for block, _ in examples(path.read_text(encoding="utf-8"))]
        outputs, failed = [], False
        for block in blocks:
            try:
                outputs.append(run_block(path, block))
            except AssertionError as error:
                outputs.append(str(error))
                failed = True
        if update and not failed:
            _update(path, outputs)
        for block, printed in zip(blocks, outputs):
            print(f"--- line {block.line}\n{printed}", end="")
        if failed:
            print(f"--- {name}: a block failed; the page was not updated")
