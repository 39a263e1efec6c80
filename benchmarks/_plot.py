"""An SVG bar chart of a run's ratios to `jax.jit`, written without dependencies.

`python benchmarks/run.py --plot PATH` draws it from the figures of that very
run: one panel per charted section (dispatch by leaf count, real programs,
library entry points), one group of horizontal bars per row of its table, one bar
per implementation, on a log scale shared by every panel. This module holds only
the drawing, and imports nothing but the standard library.
"""

import dataclasses
import math
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from xml.sax.saxutils import escape, quoteattr


@dataclasses.dataclass(frozen=True)
class RatioRow:
    """One row of a section's table, as the chart draws it: `ratios` maps each
    implementation measured in the row to its time per call ÷ the row's jax.jit
    time (so jax.jit's own is 1); `limit`, if any, is the target for filterjit."""

    label: str
    ratios: Mapping[str, float]
    limit: float | None = None


@dataclasses.dataclass(frozen=True)
class Panel:
    """One group of the chart. A panel without rows (a section not run, or
    skipped) is not drawn: the chart lists it under its notes, with `note`."""

    title: str
    rows: Sequence[RatioRow]
    note: str = ""


# Colours of the implementations, by their position in `implementations`.
PALETTE = ("#9e9e9e", "#4c78a8", "#72b7b2", "#e8a202", "#b279a2", "#54a24b")
TARGET_COLOUR = "#d62728"
INK = "#222222"
MUTED = "#666666"
GRID = "#dddddd"

WIDTH = 920
LABEL_WIDTH = 170  # the row labels, right-aligned left of the plot area
VALUE_ROOM = 60  # right of the plot area, for the value of the longest bar
MARGIN = 16
BAR = 12  # height of one bar
BAR_GAP = 2
ROW_GAP = 10
FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"
CAPTION_CHARS = 140  # characters per line of the caption and notes


def _fmt_ratio(value: float) -> str:
    return f"{value:.2f}"


def _fmt_tick(value: float) -> str:
    return f"{value:g}×"


def _wrap(text: str) -> list[str]:
    """`text` over lines of at most `CAPTION_CHARS`, broken at spaces only."""
    return textwrap.wrap(
        text, CAPTION_CHARS, break_long_words=False, break_on_hyphens=False
    )


def _text(
    x: float,
    y: float,
    content: str,
    size: int = 11,
    anchor: str = "start",
    fill: str = INK,
    extra: str = "",
) -> str:
    """A `<text>` element, its content escaped."""
    attrs = f"x='{x:.1f}' y='{y:.1f}' font-size='{size}' fill='{fill}'"
    if anchor != "start":
        attrs += f" text-anchor='{anchor}'"
    if extra:
        attrs += " " + extra
    return f"<text {attrs}>{escape(content)}</text>"


def _scale(panels: Sequence[Panel]) -> tuple[int, int]:
    """The exponents of the powers of two at the ends of the log axis: from below
    the smallest ratio (and at most 0.5) to above the largest (and at least 4), so
    that every bar has a length and 0.5, 1, 2 and 4 are always ticks."""
    values = [v for p in panels for row in p.rows for v in row.ratios.values()]
    values += [row.limit for p in panels for row in p.rows if row.limit is not None]
    for value in values:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"a ratio must be positive and finite, not {value!r}")
    low = min(-1, math.ceil(math.log2(min(values, default=1.0))) - 1)
    high = max(2, math.floor(math.log2(max(values, default=1.0))) + 1)
    return low, high


def _legend(
    x: float, y: float, names: Sequence[str], colours: Mapping[str, str], target: bool
) -> Iterator[str]:
    """Swatches and names, on one line from (x, y)."""
    yield "<g class='legend'>"
    for name in names:
        yield (
            f"<rect class='swatch' x='{x:.1f}' y='{y - 10:.1f}' width='12' "
            f"height='12' fill='{colours[name]}'/>"
        )
        yield _text(x + 17, y, name, extra="class='legend-name'")
        x += 17 + 7.0 * len(name) + 22
    yield (
        f"<line x1='{x + 6:.1f}' y1='{y - 11:.1f}' x2='{x + 6:.1f}' y2='{y + 3:.1f}' "
        f"stroke='{INK}' stroke-width='1.2' stroke-dasharray='4 3'/>"
    )
    yield _text(x + 17, y, "1 = jax.jit", extra="class='legend-name'")
    x += 17 + 7.0 * len("1 = jax.jit") + 22
    if target:
        yield (
            f"<line x1='{x + 6:.1f}' y1='{y - 11:.1f}' x2='{x + 6:.1f}' "
            f"y2='{y + 3:.1f}' stroke='{TARGET_COLOUR}' stroke-width='2' "
            "stroke-dasharray='2 2'/>"
        )
        yield _text(x + 17, y, "target for filterjit", extra="class='legend-name'")
    yield "</g>"


def render(
    title: str,
    caption: str,
    panels: Sequence[Panel],
    implementations: Sequence[str],
) -> str:
    """The SVG document of the chart, as a string.

    `caption` says which run the figures come from (it is wrapped over lines);
    `implementations` names the implementations in the order of the legend and
    of the bars in each row, and gives each its colour; those that no row
    measures are left out of the legend. Panels without rows are not drawn but
    noted below the chart.
    """
    colours = {
        name: PALETTE[i % len(PALETTE)] for i, name in enumerate(implementations)
    }
    drawn = [panel for panel in panels if panel.rows]
    for panel in drawn:
        for row in panel.rows:
            unknown = [name for name in row.ratios if name not in colours]
            if unknown:
                raise ValueError(
                    f"{panel.title}, {row.label}: implementations {unknown} are not "
                    "among `implementations`"
                )
    measured = {name for panel in drawn for row in panel.rows for name in row.ratios}
    names = [name for name in implementations if name in measured]
    any_target = any(row.limit is not None for p in drawn for row in p.rows)
    low, high = _scale(drawn)

    left = MARGIN + LABEL_WIDTH
    right = WIDTH - MARGIN - VALUE_ROOM

    def x_of(value: float) -> float:
        return left + (math.log2(value) - low) / (high - low) * (right - left)

    body: list[str] = []
    y = MARGIN + 16.0
    body.append(_text(MARGIN, y, title, size=16, extra="font-weight='bold'"))
    caption_lines = _wrap(caption)
    body.append("<g class='caption'>")
    for line in caption_lines:
        y += 15
        body.append(_text(MARGIN, y, line, fill=MUTED))
    body.append("</g>")
    y += 26
    body.extend(_legend(MARGIN, y, names, colours, any_target))
    y += 14

    ticks = [2.0**e for e in range(low, high + 1)]
    for panel in drawn:
        y += 24
        body.append(f"<g class='panel' data-title={quoteattr(panel.title)}>")
        body.append(_text(MARGIN, y, panel.title, size=13, extra="font-weight='bold'"))
        y += 10
        top = y
        # Drawn in layers: grid, bars, lines, then labels over them all.
        lines: list[str] = []
        bars: list[str] = []
        labels: list[str] = []
        for row in panel.rows:
            shown = [name for name in implementations if name in row.ratios]
            height = len(shown) * (BAR + BAR_GAP) - BAR_GAP
            labels.append(
                _text(
                    left - 8,
                    y + height / 2 + 4,
                    row.label,
                    anchor="end",
                    extra="class='row-label'",
                )
            )
            for i, name in enumerate(shown):
                value = row.ratios[name]
                bar_y = y + i * (BAR + BAR_GAP)
                end = x_of(value)
                bars.append(
                    f"<rect class='bar' data-row={quoteattr(row.label)} "
                    f"data-implementation={quoteattr(name)} "
                    f"data-ratio='{float(value)!r}' x='{left:.1f}' y='{bar_y:.1f}' "
                    f"width='{end - left:.2f}' height='{BAR}' fill='{colours[name]}'>"
                    f"<title>{escape(f'{row.label}, {name}: {_fmt_ratio(value)}')}"
                    "</title></rect>"
                )
                labels.append(
                    _text(
                        end + 4,
                        bar_y + BAR - 2,
                        _fmt_ratio(value),
                        size=10,
                        # A white halo, where the label crosses a line.
                        extra=(
                            "class='value' stroke='#ffffff' stroke-width='3' "
                            "stroke-linejoin='round' paint-order='stroke'"
                        ),
                    )
                )
            if row.limit is not None:
                limit_x = x_of(row.limit)
                lines.append(
                    f"<line class='target' data-row={quoteattr(row.label)} "
                    f"data-limit='{float(row.limit)!r}' x1='{limit_x:.1f}' "
                    f"y1='{y - 3:.1f}' x2='{limit_x:.1f}' y2='{y + height + 3:.1f}' "
                    f"stroke='{TARGET_COLOUR}' stroke-width='2' "
                    "stroke-dasharray='2 2'/>"
                )
            y += height + ROW_GAP
        bottom = y - ROW_GAP + 6
        for tick in ticks:
            tick_x = x_of(tick)
            body.append(
                f"<line x1='{tick_x:.1f}' y1='{top - 4:.1f}' x2='{tick_x:.1f}' "
                f"y2='{bottom:.1f}' stroke='{GRID}' stroke-width='1'/>"
            )
            body.append(
                _text(
                    tick_x,
                    bottom + 13,
                    _fmt_tick(tick),
                    size=10,
                    anchor="middle",
                    fill=MUTED,
                    extra="class='tick'",
                )
            )
        one = x_of(1.0)
        reference = (
            f"<line class='reference' x1='{one:.1f}' y1='{top - 6:.1f}' "
            f"x2='{one:.1f}' y2='{bottom:.1f}' stroke='{INK}' stroke-width='1.2' "
            "stroke-dasharray='4 3'/>"
        )
        body.extend([*bars, reference, *lines, *labels])
        body.append("</g>")
        y = bottom + 16

    y += 20
    footer = (
        "Time per call ÷ jax.jit's in the same run (for programs, each row's jax.jit "
        "baseline; see docs/performance.md), log scale: shorter is faster."
    )
    body.append(_text(MARGIN, y, footer, fill=MUTED))
    missing = [panel for panel in panels if not panel.rows]
    if missing:
        body.append("<g class='notes'>")
        for panel in missing:
            note = f"Not shown: {panel.title}"
            note += f" ({panel.note.rstrip('.')})." if panel.note else "."
            for line in _wrap(note):
                y += 15
                body.append(_text(MARGIN, y, line, fill=MUTED, extra="class='note'"))
        body.append("</g>")
    height = math.ceil(y + MARGIN)

    head = (
        "<?xml version='1.0' encoding='UTF-8'?>\n"
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{height}' "
        f"viewBox='0 0 {WIDTH} {height}' {FONT} role='img'>"
    )
    return "\n".join(
        [
            head,
            f"<title>{escape(title)}</title>",
            f"<desc>{escape(caption)}</desc>",
            f"<rect width='{WIDTH}' height='{height}' fill='#ffffff'/>",
            *body,
            "</svg>",
            "",
        ]
    )
