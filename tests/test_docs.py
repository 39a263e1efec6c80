"""The documentation: every public name has an API entry, and every code example
in the pages runs and prints what the page says it prints.

Conventions in `docs/**/*.md`:

- A ```` ```python ```` block is run. The blocks of one page run in order, in one
  namespace, in a fresh Python process (the way a reader would paste them).
- A ```` ```text title="Output" ```` block right after a `python` block is what that
  block prints (stdout and stderr); it is compared exactly, trailing spaces aside.
- A ```` ```py ```` block is shown but not run: a fragment, or a signature.

Running the pages takes a while, so that test is in the slow tier
(`python -m pytest --full`). `python tests/test_docs.py docs/page.md` prints what
each block of a page prints; add `--update` to write that into the page's `Output`
blocks.
"""

import ast
import concurrent.futures
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from helpers import subprocess_env


ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
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


def run_page(path: Path) -> list[str]:
    """Runs the `python` blocks of a page in a fresh process and returns what each
    printed."""
    env = subprocess_env()
    for name in ("FILTERJIT_EXPLAIN_RETRACES", "FILTERJIT_RETRACE_WARNING_THRESHOLD"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, __file__, "--run", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    if result.returncode != 0:
        raise AssertionError(
            f"{path.relative_to(ROOT)}: {result.stdout[-4000:]}{result.stderr[-4000:]}"
        )
    return json.loads(result.stdout.splitlines()[-1])


def _run_blocks_here(path: Path) -> None:
    """In the subprocess: run each block, capturing what it prints."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    outputs = []
    for block, _ in examples(path.read_text()):
        buffer = io.StringIO()
        filename = f"{path.relative_to(ROOT)}:{block.line + 1}"
        code = compile(ast.parse(block.text, filename), filename, "exec")
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            try:
                exec(code, namespace)
            except BaseException:
                traceback.print_exc()
                sys.__stdout__.write(buffer.getvalue())  # pyright: ignore[reportOptionalMemberAccess]
                raise SystemExit(f"block at line {block.line} of {path} failed")
        outputs.append(buffer.getvalue())
    print(json.dumps(outputs))


def pages_with_examples() -> list[Path]:
    return sorted(
        path
        for path in DOCS.rglob("*.md")
        if examples(path.read_text(encoding="utf-8"))
    )


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
    pages = {str(p.relative_to(DOCS)) for p in pages_with_examples()}
    assert {"index.md", "getting-started.md", "composition.md"} <= pages


_outputs: dict[Path, "concurrent.futures.Future[list[str]]"] = {}


def page_outputs(page: Path) -> list[str]:
    """What each block of `page` prints. The first call starts every page at once,
    one process each, so that the pages run in parallel."""
    if not _outputs:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2)
        for path in pages_with_examples():
            _outputs[path] = pool.submit(run_page, path)
        pool.shutdown(wait=False)
    return _outputs[page].result()


def pytest_generate_tests(metafunc: Any) -> None:
    if "page" in metafunc.fixturenames:
        pages = pages_with_examples()
        ids = [str(p.relative_to(DOCS)) for p in pages]
        metafunc.parametrize("page", pages, ids=ids)


@pytest.mark.slow  # every page in a process of its own: about a minute on 2 CPUs
def test_examples_print_what_the_page_shows(page: Path):
    outputs = page_outputs(page)
    pairs = examples(page.read_text())
    assert len(outputs) == len(pairs)
    for (block, shown), printed in zip(pairs, outputs):
        if shown is not None:
            assert _normalise(printed) == _normalise(shown.text), (
                f"{page.relative_to(ROOT)}, block at line {block.line}: it prints\n"
                f"{printed}\nbut the page shows\n{shown.text}"
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
    if args[:1] == ["--run"]:
        _run_blocks_here(Path(args[1]).resolve())
    else:
        update = "--update" in args
        for name in [a for a in args if a != "--update"]:
            path = Path(name).resolve()
            outputs = run_page(path)
            if update:
                _update(path, outputs)
            for (block, _), printed in zip(examples(path.read_text()), outputs):
                print(f"--- line {block.line}\n{printed}", end="")
