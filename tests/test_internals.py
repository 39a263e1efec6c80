"""docs/internals.md stays true: each decision in its table is made by the functions
its row names and nowhere else, as the row's search finds."""

import ast
import re
from pathlib import Path
from typing import NamedTuple

import pytest
from helpers import ROOT


PAGE = ROOT / "docs" / "internals.md"
PACKAGE = ROOT / "filterjit"


class Decision(NamedTuple):
    """A row of the page's decision table."""

    name: str
    sites: tuple[str, ...]  # `module` or `module.Class.function`
    search: re.Pattern[str]


def _cells(line: str) -> list[str]:
    # A table row's cells; `\|` is a pipe inside a cell (markdown's escape).
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [cell.strip().replace("\\|", "|") for cell in cells]


def decisions(page: str) -> list[Decision]:
    found = []
    table = page[page.index("## Decisions") :]
    for line in table.splitlines():
        if not line.startswith("| ") or line.startswith("| decision"):
            continue
        name, sites, search = _cells(line)
        named = tuple(re.findall(r"`([\w.]+)`", sites))
        (pattern,) = re.findall(r"^`(.+)`$", search)
        found.append(Decision(name, named, re.compile(pattern)))
    return found


def _sites(tree: ast.Module, module: str) -> dict[int, str]:
    """Each line's innermost enclosing function or class, as `module.Qual.name`;
    docstrings' lines left out."""
    lines: dict[int, str] = {}
    docstrings: set[int] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        body = getattr(node, "body", None)
        if isinstance(body, list) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    end = first.end_lineno or first.lineno
                    docstrings.update(range(first.lineno, end + 1))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                qualified = f"{prefix}.{child.name}"
                end = child.end_lineno or child.lineno
                for line in range(child.lineno, end + 1):
                    lines[line] = qualified
                visit(child, qualified)
            else:
                visit(child, prefix)

    visit(tree, module)
    return {line: site for line, site in lines.items() if line not in docstrings} | {
        line: "<docstring>" for line in docstrings
    }


def module_name(path: Path) -> str:
    """A module as the page names it: `_dispatch`, `_export._save`."""
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def matches(search: re.Pattern[str]) -> list[tuple[str, int, str]]:
    """Where `search` matches the package's code: (site, line number, line)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        text = path.read_text(encoding="utf-8")
        sites = _sites(ast.parse(text), module)
        for number, line in enumerate(text.splitlines(), start=1):
            code = re.sub(r"(^|\s)#.*$", "", line)  # a comment (naively)
            site = sites.get(number, module)
            if site == "<docstring>" or not search.search(code):
                continue
            found.append((site, number, line.strip()))
    return found


def _allowed(site: str, sites: tuple[str, ...]) -> bool:
    return any(site == name or site.startswith(name + ".") for name in sites)


DECISIONS = decisions(PAGE.read_text(encoding="utf-8"))


def test_the_page_has_a_search_for_every_decision():
    assert len(DECISIONS) >= 10
    modules = tuple(module_name(path) for path in PACKAGE.rglob("*.py"))
    for decision in DECISIONS:
        for site in decision.sites:
            assert _allowed(site, modules), (decision.name, site)


@pytest.mark.parametrize("decision", DECISIONS, ids=[d.name[:40] for d in DECISIONS])
def test_each_decision_is_made_where_the_page_says(decision: Decision):
    found = matches(decision.search)
    assert found, f"the search finds nothing: {decision.search.pattern}"
    elsewhere = [f for f in found if not _allowed(f[0], decision.sites)]
    assert not elsewhere, (
        f"{decision.name!r} is also made at {elsewhere}: make it in "
        f"{', '.join(decision.sites)}, or name the new site on docs/internals.md"
    )


def test_a_second_site_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # The searches see what a change would add: a second unwrapping of a partial.
    (decision,) = [d for d in DECISIONS if d.name.startswith("which callable is held")]
    copy = tmp_path / "filterjit"
    for path in PACKAGE.rglob("*.py"):
        copied = copy / path.relative_to(PACKAGE)
        copied.parent.mkdir(parents=True, exist_ok=True)
        copied.write_text(path.read_text(encoding="utf-8"))
    dispatch = copy / "_dispatch.py"
    dispatch.write_text(
        dispatch.read_text(encoding="utf-8")
        + "\n\ndef _unwrap(fun):\n    if isinstance(fun, functools.partial):\n"
        "        return fun.func\n    return fun\n"
    )
    monkeypatch.setattr(__import__(__name__), "PACKAGE", copy)
    found = [f for f in matches(decision.search) if not _allowed(f[0], decision.sites)]
    assert [site for site, _, _ in found] == ["_dispatch._unwrap"]
