"""Timing, tables and targets shared by every section of the benchmark."""

import dataclasses
import gc
import importlib
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

import jax
from _plot import RatioRow


# Display names, in the order columns are printed.
JAX = "jax.jit"
EQX = "eqx.filter_jit"
NNX = "nnx.jit"
FILTERJIT = "filterjit"
FILTERJIT_JIT = "filterjit.jit"  # jax.jit's signature, its dispatch at the top
UNDECORATED = "undecorated"

NA = "n/a"
NO_FLAX = f"nnx.jit: {NA} (flax is not installed, or does not import with this jax)."


def optional_nnx() -> ModuleType | None:
    """`flax.nnx`, or `None` when flax is not installed (or does not import with
    this jax): the benchmark runs without it and prints n/a."""
    try:
        return importlib.import_module("flax.nnx")
    except Exception:  # ImportError, or a flax built against another jax
        return None


@dataclasses.dataclass(frozen=True)
class Settings:
    """How much to measure (`quick` is the smoke run of CI), and whether to hold
    the figures against the targets of the issue."""

    quick: bool
    targets: bool

    def pick(self, full: int, quick: int) -> int:
        return quick if self.quick else full


def interleave(
    cases: Mapping[str, Callable[[], float]], rounds: int
) -> dict[str, float]:
    """Runs every case once per round, in turn, and returns each case's median.

    Each case measures one batch and returns its figure (seconds per call, or a
    ratio). Rounds rotate the order, so that drift of the machine and the cost of
    going first are shared by every implementation alike. The garbage collector
    runs before each round and is kept off during a batch.
    """
    names = list(cases)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        gc.collect()
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            gc.disable()
            try:
                samples[name].append(cases[name]())
            finally:
                gc.enable()
    return {name: statistics.median(values) for name, values in samples.items()}


def time_batch(call: Callable[[], Any], calls: int) -> Callable[[], float]:
    """A case for `interleave`: seconds per call of `calls` back-to-back calls.

    One untimed call first brings the implementation's code and data back into
    the CPU caches that the previous batch evicted. Then only the calls are
    timed: the outputs are kept, blocked on and freed after the clock stops, so
    the figure is dispatch time, and no work is left queued for the next batch.
    """

    def batch() -> float:
        outputs = [call()] * calls
        block(outputs[0])
        start = time.perf_counter_ns()
        for i in range(calls):
            outputs[i] = call()
        stop = time.perf_counter_ns()
        block(outputs)
        return (stop - start) * 1e-9 / calls

    return batch


def microseconds(
    impls: Mapping[str, Callable[[], Any]], rounds: int, calls: int
) -> dict[str, float]:
    """Median µs per call of each implementation, compiled first, then timed in
    the same interleaved rounds (see `interleave`)."""
    for call in impls.values():  # compile
        block(call())
    medians = interleave(
        {name: time_batch(call, calls) for name, call in impls.items()}, rounds
    )
    return {name: medians[name] * 1e6 for name in impls}


def program_headers(names: Sequence[str], targets: bool) -> list[str]:
    """The columns of a table of programs: each implementation's µs, then its
    ratio to jax.jit (the first), then the target and its result if checked."""
    headers = ["program", "jax.jit baseline", *(f"{name} (µs)" for name in names)]
    headers += [f"{name} ÷ jax.jit" for name in names[1:]]
    return headers + (["target", "result"] if targets else [])


def block(tree: Any) -> None:
    jax.block_until_ready(tree)


@dataclasses.dataclass(frozen=True)
class Target:
    """One target of the issue: `value` (a filterjit figure) should be at most
    `limit`."""

    section: str
    measure: str
    value: float
    limit: float
    unit: str = ""

    @property
    def passed(self) -> bool:
        return self.value <= self.limit

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "MISS"

    def describe(self) -> str:
        return f"≤ {fmt_number(self.limit)}{self.unit}"


def fmt_number(value: float | None, digits: int = 3) -> str:
    """Three significant figures, without exponents, for tables."""
    if value is None:
        return NA
    magnitude = abs(value)
    if magnitude >= 100 or magnitude == 0:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    if magnitude >= 0.01:
        return f"{value:.{digits}f}"
    return f"{value:.2g}"


def fmt_ratio(numerator: float | None, denominator: float | None) -> str:
    if numerator is None or denominator is None or denominator == 0:
        return NA
    return f"{numerator / denominator:.2f}"


def markdown_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1
) -> str:
    """A GitHub-flavoured markdown table, the first `left` columns left-aligned and
    the others right-aligned, padded so that it also reads as plain text."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        padded = [
            cell.ljust(width) if i < left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = [":" + "-" * (width - 1) for width in widths[:left]]
    rule += ["-" * (width - 1) + ":" for width in widths[left:]]
    return "\n".join([line(headers), line(rule), *(line(row) for row in rows)])


@dataclasses.dataclass
class Section:
    """What one section reports: its title, a header that says what it measures, a
    markdown table, the targets it checked, and notes; and, for the sections that
    `--plot` charts, `ratios`: each row's ratios to jax.jit, as figures."""

    title: str
    header: str
    table: str
    targets: list[Target] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    ratios: list[RatioRow] = dataclasses.field(default_factory=list)

    def render(self, check_targets: bool) -> str:
        parts = [f"## {self.title}", "", self.header]
        if self.table:  # a skipped section has none
            parts += ["", self.table]
        if self.notes:
            parts += ["", *self.notes]
        if self.targets and check_targets:
            summary = "; ".join(
                f"{t.measure} {fmt_number(t.value)}{t.unit} {t.describe()} {t.verdict}"
                for t in self.targets
            )
            parts += ["", f"Targets (filterjit): {summary}."]
        return "\n".join(parts)
