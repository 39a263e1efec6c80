"""`benchmarks/_plot.py`: the SVG chart that `benchmarks/run.py --plot` writes,
built here from hand-made figures."""

import xml.etree.ElementTree as ET

import pytest

from benchmarks._plot import Panel, RatioRow, render


SVG = "{http://www.w3.org/2000/svg}"
IMPLEMENTATIONS = ["jax.jit", "eqx.filter_jit", "nnx.jit", "filterjit"]
CAPTION = (
    "Run of 2025-01-02 03:04 UTC. Mode: full. Python 3.11.7, jax 0.10.2, equinox "
    "0.13.8, flax 0.12.8, filterjit 0.1.0 (commit abc1234); backend cpu (cpu), "
    "x86_64 with 2 CPUs, load average 0.50 at the start."
)


def _chart(*panels: Panel) -> ET.Element:
    svg = render("filterjit: time per call ÷ jax.jit", CAPTION, panels, IMPLEMENTATIONS)
    return ET.fromstring(svg.encode("utf-8"))


def _bars(root: ET.Element) -> dict[tuple[str, str], float]:
    """(row, implementation) -> the bar's drawn length."""
    bars = {}
    for rect in root.iter(f"{SVG}rect"):
        if rect.get("class") == "bar":
            key = (rect.attrib["data-row"], rect.attrib["data-implementation"])
            assert key not in bars, key
            bars[key] = float(rect.attrib["width"])
    return bars


def _texts(root: ET.Element) -> str:
    return "\n".join("".join(text.itertext()) for text in root.iter(f"{SVG}text"))


DISPATCH = Panel(
    "Dispatch by leaf count",
    [
        RatioRow(
            "N=1",
            {"jax.jit": 1.0, "eqx.filter_jit": 4.0, "nnx.jit": 8.5, "filterjit": 2.0},
            1.5,
        ),
        RatioRow(
            "N=1000",
            {"jax.jit": 1.0, "eqx.filter_jit": 1.4, "nnx.jit": 9.2, "filterjit": 0.6},
            1.1,
        ),
    ],
)
PROGRAMS = Panel(
    "Real programs",
    [
        RatioRow(
            "fresh wrapper",
            {"jax.jit": 1.0, "eqx.filter_jit": 2.5, "filterjit": 0.28},
            1.0,
        )
    ],
)


def test_one_bar_per_row_and_implementation() -> None:
    bars = _bars(_chart(DISPATCH, PROGRAMS))
    expected = {
        (row.label, name)
        for p in (DISPATCH, PROGRAMS)
        for row in p.rows
        for name in row.ratios
    }
    assert set(bars) == expected
    assert len(bars) == 4 + 4 + 3


def test_bars_are_longer_for_larger_ratios() -> None:
    bars = _bars(_chart(DISPATCH, PROGRAMS))
    # Within a row, and across rows and panels: the scale is shared.
    assert bars["N=1", "filterjit"] > bars["N=1", "jax.jit"] > 0
    assert bars["N=1", "eqx.filter_jit"] > bars["N=1", "filterjit"]
    assert bars["N=1000", "filterjit"] < bars["N=1000", "jax.jit"]
    assert bars["fresh wrapper", "filterjit"] < bars["N=1000", "filterjit"]
    assert bars["fresh wrapper", "jax.jit"] == pytest.approx(bars["N=1", "jax.jit"])
    # Log scale: 1 -> 2 as long as 2 -> 4.
    one, two = bars["N=1", "jax.jit"], bars["N=1", "filterjit"]
    assert bars["N=1", "eqx.filter_jit"] - two == pytest.approx(two - one, abs=0.05)


def test_values_legend_and_caption() -> None:
    root = _chart(DISPATCH, PROGRAMS)
    texts = _texts(root)
    for value in ("1.00", "2.00", "4.00", "8.50", "0.60", "0.28"):
        assert value in texts
    legend = [
        "".join(t.itertext())
        for g in root.iter(f"{SVG}g")
        if g.get("class") == "legend"
        for t in g.iter(f"{SVG}text")
    ]
    assert legend[: len(IMPLEMENTATIONS)] == IMPLEMENTATIONS
    # The caption is wrapped over lines; its words all come, in order.
    assert " ".join(texts.split()).count(" ".join(CAPTION.split())) == 1
    assert "commit abc1234" in texts and "jax 0.10.2" in texts
    # The reference line at 1.0, one per panel, and a target mark per row.
    lines = list(root.iter(f"{SVG}line"))
    assert sum(line.get("class") == "reference" for line in lines) == 2
    assert sum(line.get("class") == "target" for line in lines) == 3


def test_an_implementation_no_row_measures_is_not_in_the_legend() -> None:
    root = _chart(PROGRAMS)
    legend = [
        "".join(t.itertext())
        for g in root.iter(f"{SVG}g")
        if g.get("class") == "legend"
        for t in g.iter(f"{SVG}text")
    ]
    assert "nnx.jit" not in legend
    assert "filterjit" in legend


def test_a_missing_section_is_noted_and_not_drawn() -> None:
    skipped = Panel(
        "Library entry points",
        [],
        "libraries: skipped, n/a (diffrax, optimistix or lineax is not installed).",
    )
    not_run = Panel("Real programs", [], "programs: not run, not among --sections")
    root = _chart(DISPATCH, not_run, skipped)
    titles = [
        g.get("data-title") for g in root.iter(f"{SVG}g") if g.get("class") == "panel"
    ]
    assert titles == ["Dispatch by leaf count"]
    assert {row for row, _ in _bars(root)} == {"N=1", "N=1000"}
    notes = [
        "".join(t.itertext())
        for t in root.iter(f"{SVG}text")
        if t.get("class") == "note"
    ]
    joined = " ".join(notes)
    assert (
        "Not shown: Real programs (programs: not run, not among --sections)." in joined
    )
    assert "Not shown: Library entry points (libraries: skipped" in joined
    assert "is not installed))." in joined  # one full stop, after the note


def test_nothing_to_draw_still_makes_a_chart() -> None:
    root = _chart(Panel("Real programs", [], "programs: not run, not among --sections"))
    assert _bars(root) == {}
    assert "Not shown: Real programs" in _texts(root)


def test_a_ratio_that_cannot_be_drawn_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        _chart(Panel("Real programs", [RatioRow("zero", {"jax.jit": 0.0})]))
    with pytest.raises(ValueError, match="not among"):
        _chart(Panel("Real programs", [RatioRow("other", {"jax.jjit": 1.0})]))
