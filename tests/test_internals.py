"""docs/internals.md stays true: each decision in its table is made by the functions
its row names and nowhere else, as the row's syntax finds it on the syntax trees of
the package's modules (calls, names, attribute reads, type tests, imports), not in
their text; a fast-path mirror of a decision, code the fast path writes out, is
paired with the test that checks it against the reference path; and each layer of
its first table imports only the layers under it."""

import ast
import functools
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from helpers import ROOT


PAGE = ROOT / "docs" / "internals.md"
PACKAGE = ROOT / "filterjit"
TESTS = ROOT / "tests"


class Syntax(NamedTuple):
    """One item of a row's syntax, as written on the page: `attr .func .__func__`."""

    kind: str
    targets: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.kind} {' '.join(self.targets)}"


class Mirror(NamedTuple):
    """A site that writes a decision out as code the fast path generates, which no
    syntax sees: the differential test named with it checks that code."""

    site: str
    test_file: str
    test: str


class Decision(NamedTuple):
    """A row of the page's decision table."""

    name: str
    sites: tuple[str, ...]  # `module`, `module.Class.function` or `module.NAME`
    mirrors: tuple[Mirror, ...]
    syntax: tuple[Syntax, ...]


class Exempt(NamedTuple):
    """A row of the page's table of matches that are not the decision."""

    syntax: tuple[Syntax, ...]
    site: str


class Match(NamedTuple):
    """A node of the package's code that a row's syntax matches."""

    site: str
    module: str
    at: tuple[int, ...]  # where it starts and ends: line, column, line, column
    syntax: Syntax
    code: str

    def __str__(self) -> str:
        return f"{self.module}:{self.at[0]} in {self.site} ({self.syntax}): {self.code}"


# The page's tables


def _cells(line: str) -> list[str]:
    # A table row's cells; `\|` is a pipe inside a cell (markdown's escape).
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [cell.strip().replace("\\|", "|") for cell in cells]


def _table(page: str, heading: str) -> list[list[str]]:
    """The cells of each body row of the table under `heading`."""
    section = page[page.index(heading) + len(heading) :]
    section = re.split(r"^#", section, maxsplit=1, flags=re.M)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [_cells(line) for line in rows[2:]]  # after the head and its rule


_TARGET = r"\.?\w+(\.\w+)*(\(\*\))?(&\w+(\.\w+)*)*"


def parse_syntax(cell: str) -> tuple[Syntax, ...]:
    """The items of a syntax cell, each a code span `kind target target...`."""
    found = []
    for span in re.findall(r"`([^`]+)`", cell):
        kind, _, rest = span.partition(" ")
        assert kind in _MATCHERS, f"{span!r}: a kind is one of {sorted(_MATCHERS)}"
        if kind == "expr":
            ast.parse(rest, mode="eval")
            targets: tuple[str, ...] = (rest,)
        elif kind == "text":
            targets = tuple(shlex.split(rest))
        else:
            targets = tuple(rest.split())
            assert all(re.fullmatch(_TARGET, t) for t in targets), span
        assert targets, span
        found.append(Syntax(kind, targets))
    return tuple(found)


def decisions(page: str) -> list[Decision]:
    found = []
    for name, sites, syntax in _table(page, "## Decisions"):
        paired = re.findall(r"`([\w.]+)` \(mirror: `([\w.]+)::(\w+)`\)", sites)
        mirrors = tuple(Mirror(*pair) for pair in paired)
        named = tuple(re.findall(r"`([\w.]+)`", sites))
        found.append(Decision(name, named, mirrors, parse_syntax(syntax)))
    return found


def exemptions(page: str) -> list[Exempt]:
    found = []
    for syntax, site, _why in _table(page, "### Matches that are not the decision"):
        (named,) = re.findall(r"^`([\w.]+)`$", site)
        found.append(Exempt(parse_syntax(syntax), named))
    return found


# The package's modules


def module_name(path: Path, package: Path) -> str:
    """A module as the page names it: `_dispatch`, `_export._save`."""
    return ".".join(path.relative_to(package).with_suffix("").parts)


_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _defined_name(node: ast.AST) -> str | None:
    """The name a function, a class or an assignment to one name defines."""
    if isinstance(node, _DEFINITIONS):
        return node.name
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target = node.targets[0]
        return target.id if isinstance(target, ast.Name) else None
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    return None


class _Module:
    """A module of the package: its syntax tree, and what each import names."""

    def __init__(self, name: str, source: str):
        self.name = name
        self.source = source
        self.tree = ast.parse(source)
        # The package a relative import starts from (`__init__`: its own).
        package = ["filterjit", *name.split(".")][:-1]
        self.aliases: dict[str, str] = {}  # a name an import binds: what it names
        self.imported: dict[ast.AST, list[str]] = {}  # an import: what it names
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    bound = alias.asname or alias.name.partition(".")[0]
                    self.aliases[bound] = alias.name if alias.asname else bound
                    self.imported.setdefault(node, []).append(alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: `from ._binding import Binder`
                    up = package[: len(package) - node.level + 1]
                    base = ".".join([*up, *filter(None, [node.module])])
                names = [f"{base}.{alias.name}" for alias in node.names]
                for alias, name in zip(node.names, names):
                    self.aliases[alias.asname or alias.name] = name
                self.imported[node] = [base, *names]
        # Each node with its site, by the node's type; and every site.
        self.sites: dict[type, list[tuple[str, ast.AST]]] = {}
        self.named: set[str] = set()
        for site, node in self.nodes():
            self.sites.setdefault(type(node), []).append((site, node))
            self.named.add(site)
        # Strings standing as statements (docstrings): prose, not code.
        self.prose = {
            node.value
            for node in ast.walk(self.tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        }

    def resolved(self, node: ast.AST) -> str | None:
        """The dotted name that `a.b.c` reads, its imports resolved: `ft.partial`
        is `functools.partial`, `Binder` is `filterjit._binding.Binder`."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolved(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def nodes(self) -> Iterator[tuple[str, ast.AST]]:
        """Each node with its site: the innermost function or class around it, as
        `module.Class.function`; at module level, `module.NAME` in an assignment
        to one name, else `module`. A decorator is of the scope around."""

        def walk(node: ast.AST, site: str) -> Iterator[tuple[str, ast.AST]]:
            if isinstance(node, _DEFINITIONS):
                inner = f"{site}.{node.name}"
                yield inner, node
                for field, value in ast.iter_fields(node):
                    scope = site if field == "decorator_list" else inner
                    for item in value if isinstance(value, list) else [value]:
                        if isinstance(item, ast.AST):
                            yield from walk(item, scope)
                return
            yield site, node
            for child in ast.iter_child_nodes(node):
                name = _defined_name(child) if site == self.name else None
                at_module = name is not None and not isinstance(child, _DEFINITIONS)
                yield from walk(child, f"{site}.{name}" if at_module else site)

        return walk(self.tree, self.name)


def modules(package: Path) -> list[_Module]:
    """The modules of `package`, each parsed once (a copy's too)."""
    paths = sorted(package.rglob("*.py"))
    return [_module(module_name(p, package), p.read_text("utf-8")) for p in paths]


@functools.cache
def _module(name: str, source: str) -> _Module:
    return _Module(name, source)


def _exists(site: str) -> bool:
    """Whether `site` (`module`, `module.Class.function`, `module.NAME`) exists."""
    return any(site in module.named for module in modules(PACKAGE))


# What each kind of syntax matches (the page says it in words)


def _names(name: str | None, target: str) -> bool:
    """Whether the dotted `name` is `target`, or ends with it: `functools.partial`
    is `partial`; `self.x.parent_trace` is `.parent_trace` and `parent_trace`."""
    if name is None:
        return False
    if target.startswith("."):
        return name.endswith(target)
    return name == target or name.endswith("." + target)


def _match_call(targets: tuple[str, ...], node: ast.AST, module: _Module) -> bool:
    if not isinstance(node, ast.Call):
        return False
    starred = bool(node.args) and isinstance(node.args[0], ast.Starred)
    for target in targets:
        name = target.removesuffix("(*)")
        if name != target and not starred:
            continue
        if name.startswith("."):
            method = node.func
            if isinstance(method, ast.Attribute) and method.attr == name[1:]:
                return True
        elif _names(module.resolved(node.func), name):
            return True
    return False


def _match_name(targets: tuple[str, ...], node: ast.AST, module: _Module) -> bool:
    if isinstance(node, ast.Name | ast.Attribute):
        if isinstance(node.ctx, ast.Store | ast.Del):
            return False
        named = [module.resolved(node)]
    else:
        named = module.imported.get(node, [])
    return any(_names(name, target) for name in named for target in targets)


_GETATTR = ("getattr", "hasattr", "inspect.getattr_static")


def _match_attr(targets: tuple[str, ...], node: ast.AST, module: _Module) -> bool:
    attributes = {target.removeprefix(".") for target in targets}
    if isinstance(node, ast.Attribute):
        return isinstance(node.ctx, ast.Load) and node.attr in attributes
    if not isinstance(node, ast.Call):
        return False
    function = module.resolved(node.func) or ""
    if function in _GETATTR or function.endswith(".__getattribute__"):
        named = node.args[1:2]
    elif function == "operator.attrgetter":
        named = node.args
    else:
        return False
    return any(isinstance(a, ast.Constant) and a.value in attributes for a in named)


def _classes(node: ast.expr, module: _Module) -> list[str]:
    """The classes an expression names: `A`, `(A, *B)`, `A | B`."""
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [name for element in node.elts for name in _classes(element, module)]
    if isinstance(node, ast.Starred):
        return _classes(node.value, module)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _classes(node.left, module) + _classes(node.right, module)
    return [name] if (name := module.resolved(node)) is not None else []


def _is_type_of(node: ast.expr, module: _Module) -> bool:
    return isinstance(node, ast.Call) and module.resolved(node.func) == "type"


def _type_tested(node: ast.AST, module: _Module) -> list[str] | None:
    """The classes a type test tests against (`isinstance(x, C)`, `issubclass(k,
    C)`, `type(x) is C`, `type(x) in (C, D)`, `case C():`); `None`: not one."""
    if isinstance(node, ast.Call) and len(node.args) == 2:
        if module.resolved(node.func) in ("isinstance", "issubclass"):
            return _classes(node.args[1], module)
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        sides = [node.left, node.comparators[0]]
        tests = ast.Is | ast.IsNot | ast.Eq | ast.NotEq | ast.In | ast.NotIn
        if isinstance(node.ops[0], tests) and any(
            _is_type_of(s, module) for s in sides
        ):
            return [
                c
                for s in sides
                if not _is_type_of(s, module)
                for c in _classes(s, module)
            ]
    if isinstance(node, ast.MatchClass):
        return _classes(node.cls, module)
    return None


def _match_isinstance(targets: tuple[str, ...], node: ast.AST, module: _Module) -> bool:
    tested = _type_tested(node, module)
    if tested is None:
        # Classes kept together for a test to come: `ARRAYS = (jax.Array, np.ndarray)`.
        if isinstance(node, ast.BinOp) and not isinstance(node.op, ast.BitOr):
            return False
        if not isinstance(node, ast.Tuple | ast.BinOp):
            return False
        tested = _classes(node, module)
        targets = tuple(target for target in targets if "&" in target)
    return any(
        all(any(_names(name, part) for name in tested) for part in target.split("&"))
        for target in targets
    )


def _match_import(targets: tuple[str, ...], node: ast.AST, module: _Module) -> bool:
    if isinstance(node, ast.Name | ast.Attribute):
        named = [module.resolved(node) or ""]
    else:
        named = module.imported.get(node, [])
    return any(
        name == target or name.startswith(target + ".")
        for name in named
        for target in targets
    )


def _match_keyword(targets: tuple[str, ...], node: ast.AST, module: _Module) -> bool:
    if isinstance(node, ast.keyword):
        return node.arg in targets
    keys: list[ast.expr | None] = []
    if isinstance(node, ast.Subscript):
        keys = [node.slice]
    elif isinstance(node, ast.Dict):
        keys = list(node.keys)
    return any(isinstance(k, ast.Constant) and k.value in targets for k in keys)


def _match_text(targets: tuple[str, ...], node: ast.AST, module: _Module) -> bool:
    if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
        return False
    return node not in module.prose and any(t in node.value for t in targets)


@functools.cache
def _pattern(expression: str) -> ast.expr:
    return ast.parse(expression, mode="eval").body


def _same_shape(pattern: ast.AST, node: ast.AST, module: _Module) -> bool:
    """Whether `node` has the shape of `pattern`, in which `_` is any expression
    and a name is what `_names` says."""
    if isinstance(pattern, ast.Name) and pattern.id == "_":
        return True
    if isinstance(pattern, ast.Name | ast.Attribute):
        return _names(module.resolved(node), ast.unparse(pattern))
    if type(pattern) is not type(node):
        return False
    if isinstance(pattern, ast.JoinedStr) and isinstance(node, ast.JoinedStr):
        return _within(pattern.values, node.values, module)
    for field, value in ast.iter_fields(pattern):
        other = getattr(node, field)
        if isinstance(value, ast.expr_context):
            continue
        values = value if isinstance(value, list) else [value]
        others = other if isinstance(other, list) else [other]
        if len(values) != len(others):
            return False
        for a, b in zip(values, others):  # pyright: ignore[reportUnknownArgumentType]
            same = _same_shape(a, b, module) if isinstance(a, ast.AST) else a == b
            if not same:
                return False
    return True


def _within(pattern: list[ast.expr], parts: list[ast.expr], module: _Module) -> bool:
    """Whether the parts of an f-string hold those of `pattern` in a row: its first
    text may end one of theirs, its last begin one (`f"{_}[{_}]"` is in
    `f"argument {name}[{i}] of f"`)."""
    last = len(pattern) - 1

    def same(index: int, a: ast.expr, b: ast.expr) -> bool:
        if isinstance(a, ast.Constant) and isinstance(b, ast.Constant):
            text, other = str(a.value), str(b.value)
            ends = (other.endswith(text) if index == 0 else True) and (
                other.startswith(text) if index == last else True
            )
            return ends and (text == other or index in (0, last))
        return _same_shape(a, b, module)

    return any(
        all(same(i, a, b) for i, (a, b) in enumerate(zip(pattern, parts[start:])))
        for start in range(len(parts) - last)
    )


def _match_expr(targets: tuple[str, ...], node: ast.AST, module: _Module) -> bool:
    return any(_same_shape(_pattern(target), node, module) for target in targets)


_MATCHERS: dict[str, Callable[[tuple[str, ...], ast.AST, _Module], bool]] = {
    "call": _match_call,
    "name": _match_name,
    "attr": _match_attr,
    "isinstance": _match_isinstance,
    "import": _match_import,
    "keyword": _match_keyword,
    "text": _match_text,
    "expr": _match_expr,
}
_NAMES = (ast.Name, ast.Attribute, ast.Import, ast.ImportFrom)
# The types of node each kind can match.
_NODES: dict[str, tuple[type, ...]] = {
    "call": (ast.Call,),
    "name": _NAMES,
    "attr": (ast.Attribute, ast.Call),
    "isinstance": (ast.Call, ast.Compare, ast.MatchClass, ast.Tuple, ast.BinOp),
    "import": _NAMES,
    "keyword": (ast.keyword, ast.Subscript, ast.Dict),
    "text": (ast.Constant,),
}


def _candidates(item: Syntax, module: _Module) -> Iterator[tuple[str, ast.AST]]:
    """The nodes of `module` of the types that `item` can match, with their sites."""
    types = _NODES.get(item.kind, ())
    for target in item.targets if item.kind == "expr" else ():
        root = type(_pattern(target))
        types += (
            (ast.Name, ast.Attribute) if root in (ast.Name, ast.Attribute) else (root,)
        )
    for kind in dict.fromkeys(types):
        yield from module.sites.get(kind, [])


def matches(syntax: tuple[Syntax, ...]) -> list[Match]:
    """Every node of the package's code that an item of `syntax` matches."""
    return list(_matches_in(PACKAGE, syntax))


@functools.cache
def _matches_in(package: Path, syntax: tuple[Syntax, ...]) -> tuple[Match, ...]:
    found = []
    for module in modules(package):
        lines = module.source.splitlines()
        for item in syntax:
            for site, node in _candidates(item, module):
                if _MATCHERS[item.kind](item.targets, node, module):
                    fields = ("lineno", "col_offset", "end_lineno", "end_col_offset")
                    at = tuple(getattr(node, field) for field in fields)
                    code = lines[at[0] - 1].strip()
                    found.append(Match(site, module.name, at, item, code))
    return tuple(sorted(found, key=lambda m: (m.module, m.at)))


def _allowed(site: str, sites: tuple[str, ...]) -> bool:
    return any(site == name or site.startswith(name + ".") for name in sites)


@functools.cache
def _exempt(package: Path) -> set[tuple[str, tuple[int, ...]]]:
    """The nodes that the page's exemptions match at their sites in `package`."""
    return {
        (match.module, match.at)
        for exempt in EXEMPT
        for match in _matches_in(package, exempt.syntax)
        if _allowed(match.site, (exempt.site,))
    }


def second_sites(decision: Decision) -> list[Match]:
    """Where the decision's syntax matches outside the sites its row names and the
    page's exemptions: once a line."""
    exempt = _exempt(PACKAGE)
    found: dict[tuple[str, int], Match] = {}
    for match in matches(decision.syntax):
        if _allowed(match.site, decision.sites) or (match.module, match.at) in exempt:
            continue
        found.setdefault((match.site, match.at[0]), match)
    return list(found.values())


DECISIONS = decisions(PAGE.read_text(encoding="utf-8"))
EXEMPT = exemptions(PAGE.read_text(encoding="utf-8"))

# Second sites the package has today (issue 58), each with the edit that removes
# it: while a row has any, its test below is an expected failure; once one is gone,
# `test_no_second_site_but_those_known` says to drop it from here.
SECOND_SITES: dict[str, dict[str, str]] = {}


def _known(decision: Decision) -> dict[str, str]:
    found = [s for name, s in SECOND_SITES.items() if decision.name.startswith(name)]
    return found[0] if found else {}


def _marked(decision: Decision) -> object:
    known = _known(decision)
    reason = "second sites: " + "; ".join(f"{s}: {fix}" for s, fix in known.items())
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if known else []
    return pytest.param(decision, id=decision.name[:40], marks=marks)


def test_the_page_has_a_row_for_every_decision():
    names = [decision.name for decision in DECISIONS]
    for decision in (
        "which leaves are arrays",
        "how a static value is keyed",
        "the level of a call",
        "every access to JAX's private API",
        "what a call binds",
        "which callable is held",
        "which callables share caches",
        "the cache key",
        "how an argument is named",
        "finishing an output",
        "donation",
        "what a call hands its trace",
    ):
        assert any(name.startswith(decision) for name in names), decision
    for decision in DECISIONS:
        assert decision.sites and decision.syntax, decision.name


def test_every_site_on_the_page_exists():
    sites = [site for decision in DECISIONS for site in decision.sites]
    sites += [exempt.site for exempt in EXEMPT]
    missing = [site for site in sites if not _exists(site)]
    assert not missing, f"docs/internals.md names what filterjit/ lacks: {missing}"


def test_each_mirror_is_paired_with_its_differential_test():
    mirrors = [mirror for decision in DECISIONS for mirror in decision.mirrors]
    assert {mirror.site.split(".")[0] for mirror in mirrors} == {"_fastpath"}
    for mirror in mirrors:
        tree = ast.parse((TESTS / mirror.test_file).read_text(encoding="utf-8"))
        tests = {_defined_name(node) for node in tree.body}
        assert mirror.test.startswith("test_") and mirror.test in tests, mirror


def test_each_exemption_matches_at_its_site():
    # Of the same kind as a row's item and narrower; and not stale.
    items = [item for decision in DECISIONS for item in decision.syntax]
    for exempt in EXEMPT:
        for syntax in exempt.syntax:
            assert any(
                syntax.kind == item.kind and set(syntax.targets) <= set(item.targets)
                for item in items
            ), syntax
            found = [m for m in matches((syntax,)) if _allowed(m.site, (exempt.site,))]
            assert found, f"{syntax} no longer matches in {exempt.site}: drop the row"


@pytest.mark.parametrize("decision", [_marked(decision) for decision in DECISIONS])
def test_each_decision_is_made_where_the_page_says(decision: Decision):
    found = [m for m in matches(decision.syntax) if _allowed(m.site, decision.sites)]
    assert found, f"the syntax finds nothing where the decision is made: {decision}"
    elsewhere = "\n".join(map(str, second_sites(decision)))
    assert not elsewhere, (
        f"{decision.name!r} is also made at\n{elsewhere}\nmake it in "
        f"{', '.join(decision.sites)}, or name the new site on docs/internals.md"
    )


@pytest.mark.parametrize(
    "decision", [d for d in DECISIONS if _known(d)], ids=lambda d: d.name[:40]
)
def test_no_second_site_but_those_known(decision: Decision):
    # What the expected failure above lets by: no new second site, none fixed.
    known = _known(decision)
    found = second_sites(decision)
    new = "\n".join(str(match) for match in found if match.site not in known)
    assert not new, f"{decision.name!r} is also made at\n{new}"
    gone = set(known) - {match.site for match in found}
    assert not gone, f"{gone} no longer make {decision.name!r}: drop them above"


def _copy_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the package that the searches read in its place."""
    copy = tmp_path / "filterjit"
    for path in PACKAGE.rglob("*.py"):
        copied = copy / path.relative_to(PACKAGE)
        copied.parent.mkdir(parents=True, exist_ok=True)
        copied.write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", copy)
    return copy


# For each decision, code that makes it again: (module, code, the new site).
SECOND_SITE_ADDED = {
    "which leaves are arrays": (
        "_dispatch",
        "import numpy\n\ndef _is_array(x):\n"
        "    return isinstance(x, (numpy.ndarray, jax.Array))\n",
        "_dispatch._is_array",
    ),
    "how a static value is keyed": (
        "_dispatch",
        "def _float_key(x):\n    return type(x), float.hex(x)\n",
        "_dispatch._float_key",
    ),
    "the level of a call": (
        "_output",
        "def _outer(trace):\n    return getattr(trace, 'parent_trace', None)\n",
        "_output._outer",
    ),
    "every access to JAX's private API": (
        "_dispatch",
        "def _core():\n    from jax._src import core\n    return core\n",
        "_dispatch._core",
    ),
    "what a call binds": (  # an `inspect.signature` outside the record
        "_jax_jit",
        "def _parameters(fun):\n    from inspect import signature as read\n"
        "    return read(fun).parameters\n",
        "_jax_jit._parameters",
    ),
    "which callable is held": (  # a `.func` read outside the unwrapping function
        "_dispatch",
        "def _unwrap(fun):\n    return fun.func\n",
        "_dispatch._unwrap",
    ),
    "which callables share caches": (
        "_jit",
        "def _dispatcher(fun, options):\n    return Dispatcher(fun, options)\n",
        "_jit._dispatcher",
    ),
    "the cache key": (
        "_aot",
        "def _key(partition, leaves):\n    return partition.reference_key(leaves)\n",
        "_aot._key",
    ),
    "how an argument is named": (
        "_errors",
        "def _label(i):\n    return f'args[{i}]'\n",
        "_errors._label",
    ),
    "when a hit is made": (  # a hit made by a trace, not after a run
        "_entry",
        "def _hit_now(plan):\n    from ._fastpath import hit_caller\n"
        "    return hit_caller(plan)\n",
        "_entry._hit_now",
    ),
    "finishing an output": (
        "_aot",
        "class _Stage:\n    def out(self, spec, out, inputs):\n"
        "        return spec.build(out, inputs)\n",
        "_aot._Stage.out",
    ),
    "donation": (
        "_aot",
        "def _jitted(f):\n    return jax.jit(f, donate_argnums=(0,))\n",
        "_aot._jitted",
    ),
    "what a call hands its trace": (
        "_dispatch",
        "import threading\n\n_call_under_way = threading.local()\n",
        "_dispatch._call_under_way",
    ),
}
# More of the syntax the unwrapping and binding rows see, and in any spelling.
MORE_ADDED = [
    (
        "which callable is held",
        "_output",  # `isinstance(x, functools.partial)` elsewhere
        "import functools as _ft\n\ndef _is_partial(x):\n"
        "    return isinstance(x, _ft.partial)\n",
        "_output._is_partial",
    ),
    (
        "which callable is held",
        "_cache",
        "def _function_of(method):\n    return getattr(method, '__func__', method)\n",
        "_cache._function_of",
    ),
    (
        "which callable is held",
        "_aot",
        "import jax.tree_util as jtu\n\ndef _held(f):\n"
        "    return type(f) is jtu.Partial or type(f) in (types.MethodType,)\n",
        "_aot._held",
    ),
    (
        "which callable is held",
        "_cache",
        "def _pieces(fun):\n    match fun:\n        case ft.partial():\n"
        "            return fun.args\n    return ()\n",
        "_cache._pieces",
    ),
    (
        "how an argument is named",
        "_output",
        "def _label(names, i):\n    return f'*{names[-1]}[{i - len(names)}]'\n",
        "_output._label",
    ),
    (
        "what a call binds",
        "_entry",
        "def _bound(signature, args):\n    bound = signature.bind(*args)\n"
        "    bound.apply_defaults()\n    return bound\n",
        "_entry._bound",
    ),
    (
        "what a call binds",
        "_export._load",
        "def _binder(signature, name):\n    return Binder(signature, name)\n",
        "_export._load._binder",
    ),
]
ADDED = [(name, *case) for name, case in SECOND_SITE_ADDED.items()] + MORE_ADDED


def _row(name: str) -> Decision:
    (decision,) = [d for d in DECISIONS if d.name.startswith(name)]
    return decision


def test_every_decision_has_a_second_site_added_below():
    assert {_row(name) for name in SECOND_SITE_ADDED} == set(DECISIONS)


@pytest.mark.parametrize(
    ("name", "module", "code", "site"), ADDED, ids=[case[3] for case in ADDED]
)
def test_a_second_site_is_found(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    module: str,
    code: str,
    site: str,
):
    decision = _row(name)
    before = {match.site for match in second_sites(decision)}
    copy = _copy_package(tmp_path, monkeypatch)
    path = copy / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text(encoding="utf-8") + "\n\n" + code, encoding="utf-8")
    after = {match.site for match in second_sites(decision)}
    assert after - before == {site}


def test_prose_is_not_a_second_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # A comment or a docstring that shows the syntax makes no decision.
    before = {d.name: second_sites(d) for d in DECISIONS}
    copy = _copy_package(tmp_path, monkeypatch)
    path = copy / "_dispatch.py"
    prose = (
        "\n\ndef _documented(fun):\n"
        '    """`fun.func`, `inspect.signature(fun)`, `Binder(s, n)`, "<argument 0>",\n'
        '    isinstance(fun, functools.partial), from jax._src import core."""\n'
        "    # return fun.__func__, Dispatcher(fun, options), x.reference_key(l)\n"
        "    return fun\n"
    )
    path.write_text(path.read_text(encoding="utf-8") + prose, encoding="utf-8")
    assert {d.name: second_sites(d) for d in DECISIONS} == before


# The layers


def layers(page: str) -> list[tuple[str, tuple[str, ...]]]:
    """The page's layers, top first, each with the modules it names (not what the
    cell says of them in parentheses)."""
    found = []
    for name, modules, _holds in _table(page, "# Internals"):
        named = re.sub(r"\([^)]*\)", "", modules)
        found.append((name, tuple(re.findall(r"`([\w.]+)`", named))))
    return found


def _imported(path: Path, package: Path) -> Iterator[tuple[str, int]]:
    """The package's modules that the module at `path` imports, as the page names
    them, with the line of each import."""
    parts = path.relative_to(package).with_suffix("").parts
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        base = list(parts[: len(parts) - node.level])
        if node.module is not None:
            yield ".".join([*base, node.module]), node.lineno
        else:
            for alias in node.names:
                yield ".".join([*base, alias.name]), node.lineno


def upward_imports() -> list[str]:
    """Each import of a module of an upper layer than the importing module's (a
    module named in two layers counts in the upper one)."""
    named = layers(PAGE.read_text(encoding="utf-8"))
    rank: dict[str, int] = {}
    for index, (_, modules) in enumerate(named):
        for module in modules:
            rank.setdefault(module, index)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path, PACKAGE)
        if module not in rank:
            continue
        for target, line in _imported(path, PACKAGE):
            if rank.get(target, rank[module]) < rank[module]:
                layer, upper = named[rank[module]][0], named[rank[target]][0]
                found.append(f"{module}:{line} ({layer}) imports {target} ({upper})")
    return found


def test_each_layer_imports_only_the_layers_under_it():
    named = layers(PAGE.read_text(encoding="utf-8"))
    assert [name for name, _ in named][:2] == ["entry points", "export"]
    listed = {module for _, modules in named for module in modules}
    private = {module_name(path, PACKAGE) for path in PACKAGE.rglob("_*.py")}
    unlisted = {m for m in private if not m.endswith(("__init__", "__main__"))}
    assert unlisted <= listed, f"in no layer of docs/internals.md: {unlisted - listed}"
    upward = "\n".join(upward_imports())
    assert not upward, f"imports of an upper layer:\n{upward}"


@pytest.mark.parametrize(
    ("module", "code"),
    [
        ("_fastpath", "from ._dispatch import Dispatcher\n"),  # under the dispatcher
        ("_exact", "from . import _owners\n"),  # a record, of the wrapper's layer
        ("_export._values", "from .._jit import filter_jit\n"),
    ],
)
def test_an_upward_import_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, code: str
):
    package = _copy_package(tmp_path, monkeypatch)
    path = package.joinpath(*module.split(".")).with_suffix(".py")
    path.write_text(path.read_text(encoding="utf-8") + "\n" + code, encoding="utf-8")
    assert any(line.startswith(f"{module}:") for line in upward_imports())
