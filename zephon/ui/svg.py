"""Charts drawn on the server as inline SVG: axes with round ticks, a legend, lines, markers,
stacked bars or areas, and rows of categories. No script runs in the browser to draw them.

Why here and not a chart library in the page: a run's page drew its three charts with
plotly.js, 4.8 MB of script that chromium spent 0.5-1 s running on every view. A page of
SVG is drawn by the browser's own layout in milliseconds, and is text the tests can read.

Cost stays bounded by the number of elements, not the number of points: up to
``MAX_ELEMENTS`` points a series draws one element per point (each with its hover text, a
``<title>``); beyond, a series of markers is one ``<path>`` of dots and a stack of bars is
one filled area per part, so 100,000 saves are still a few dozen elements.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from xml.sax.saxutils import escape, quoteattr

__all__ = ["MAX_ELEMENTS", "PALETTE", "Plot", "Rows"]

#: points up to which a series draws an element (and a hover text) per point
MAX_ELEMENTS = 300
#: series colours in order (colour-blind-safe, after Okabe and Ito), then repeated
PALETTE = ("#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#f0e442", "#000")

WIDTH, HEIGHT = 1100, 260
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 28, 40
_TIME_STEPS = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5,
    1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800,
    3600, 7200, 10800, 21600, 43200,
    86400, 2 * 86400, 7 * 86400, 14 * 86400, 30 * 86400, 91 * 86400, 365 * 86400,
)  # fmt: skip


def _num(value: float) -> str:
    """A coordinate in the SVG: one decimal is a tenth of a pixel."""
    return f"{value:.1f}".rstrip("0").rstrip(".")


def nice_ticks(low: float, high: float, count: int = 6) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten) covering ``low..high``."""
    if high <= low:
        high = low + 1.0
    raw = (high - low) / max(1, count)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    digits = max(0, 1 - math.floor(math.log10(step)))
    first, last = math.ceil(low / step - 1e-9), math.floor(high / step + 1e-9)
    ticks = [round(k * step, digits) + 0.0 for k in range(first, last + 1)]
    return ticks


def time_ticks(low: float, high: float, count: int = 6) -> tuple[list[float], str]:
    """Tick times (POSIX seconds, UTC) at a round interval, and the strftime format to label
    them with: dates for days apart, times of day otherwise (with milliseconds below 1 s)."""
    span = max(0.001, high - low)
    step = next((s for s in _TIME_STEPS if span / s <= count), _TIME_STEPS[-1])
    first = math.ceil(low / step) * step
    ticks = [first + i * step for i in range(int((high - first) // step) + 1)]
    if step >= 86400:
        fmt = "%Y-%m-%d"
    elif step >= 60:
        fmt = "%H:%M"
    else:
        fmt = "%H:%M:%S" if step >= 1 else "%H:%M:%S.%f"
    return ticks, fmt


def time_label(at: float, fmt: str) -> str:
    """``at`` (POSIX seconds) in UTC by ``fmt``; microseconds are cut to milliseconds."""
    text = datetime.fromtimestamp(round(at, 3), UTC).strftime(fmt)
    return text[:-3] if fmt.endswith("%f") else text


def _label(value: float) -> str:
    if value == int(value) and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:.3g}"


@dataclass
class _Series:
    name: str
    kind: str  # line, markers, bars, area
    xs: list[float]
    ys: list[float]
    color: str
    texts: list[str] | None = None
    symbol: str = "circle"
    size: float = 7.0
    sizes: list[float] | None = None
    base: list[float] | None = None  # stacked: where each bar or area starts


@dataclass
class Plot:
    """One chart with a numeric y axis and a numeric or time x axis (``x_time``: xs are
    POSIX seconds). Add series, then ``render()`` the ``<svg>`` element."""

    x_title: str
    y_title: str
    x_time: bool = False
    height: int = HEIGHT
    #: the x range to draw (to line up with another chart); by default the data's
    x_range: tuple[float, float] | None = None
    series: list[_Series] = field(default_factory=list)

    def _color(self, color: str | None) -> str:
        return color or PALETTE[len(self.series) % len(PALETTE)]

    def line(
        self,
        name: str,
        xs: Sequence[float],
        ys: Sequence[float],
        *,
        color: str | None = None,
        texts: Sequence[str] | None = None,
        markers: bool = True,
        sizes: Sequence[float] | None = None,
    ) -> None:
        """A line through the points; with a marker (and hover text) per point when there
        are few enough of them and ``markers``."""
        color = self._color(color)
        self.series.append(_Series(name, "line", list(xs), list(ys), color))
        if markers and len(xs) <= MAX_ELEMENTS:
            texts = list(texts) if texts is not None else None
            sizes = list(sizes) if sizes is not None else None
            self.series.append(
                _Series("", "markers", list(xs), list(ys), color, texts, sizes=sizes)
            )

    def markers(
        self,
        name: str,
        xs: Sequence[float],
        ys: Sequence[float],
        *,
        color: str | None = None,
        texts: Sequence[str] | None = None,
        symbol: str = "circle",
        size: float = 9.0,
    ) -> None:
        """A marker per point: ``circle``, ``x``, ``triangle`` or ``square``."""
        self.series.append(
            _Series(
                name,
                "markers",
                list(xs),
                list(ys),
                self._color(color),
                list(texts) if texts is not None else None,
                symbol,
                size,
            )
        )

    def stacked(
        self,
        names: Sequence[str],
        xs: Sequence[float],
        columns: Sequence[Sequence[float]],
        *,
        colors: Sequence[str] | None = None,
    ) -> None:
        """Parts stacked per x (``columns[i][j]``: part i at xs[j]): bars while there are at
        most ``MAX_ELEMENTS`` xs, one filled area per part beyond."""
        kind = "bars" if len(xs) <= MAX_ELEMENTS else "area"
        base = [0.0] * len(xs)
        for index, (name, column) in enumerate(zip(names, columns, strict=True)):
            color = colors[index] if colors else self._color(None)
            texts = (
                [f"{name} at {_label(x)}: {y:.3f}" for x, y in zip(xs, column, strict=True)]
                if kind == "bars"
                else None
            )
            self.series.append(
                _Series(name, kind, list(xs), list(column), color, texts, base=list(base))
            )
            base = [b + y for b, y in zip(base, column, strict=True)]

    # -- drawing -------------------------------------------------------------------------

    def _ranges(self) -> tuple[float, float, float, float]:
        xs = [x for s in self.series for x in s.xs]
        ys = [0.0] + [
            y + (s.base[i] if s.base else 0.0) for s in self.series for i, y in enumerate(s.ys)
        ]
        x0, x1 = self.x_range or ((min(xs), max(xs)) if xs else (0.0, 1.0))
        if x1 == x0:
            x0, x1 = x0 - 1, x1 + 1
        pad = (x1 - x0) * 0.02
        y1 = max(ys)
        return x0 - pad, x1 + pad, min(0.0, min(ys)), (y1 * 1.08 if y1 > 0 else 1.0)

    def render(self, *, label: str) -> str:
        """The chart as an ``<svg>`` element; ``label`` names it for screen readers."""
        x0, x1, y0, y1 = self._ranges()
        plot_w, plot_h = WIDTH - LEFT - RIGHT, self.height - TOP - BOTTOM

        def sx(x: float) -> float:
            return LEFT + (x - x0) / (x1 - x0) * plot_w

        def sy(y: float) -> float:
            return TOP + plot_h - (y - y0) / (y1 - y0) * plot_h

        parts = [
            f'<svg class="plot" viewBox="0 0 {WIDTH} {self.height}" role="img" '
            f'aria-label={quoteattr(label)} xmlns="http://www.w3.org/2000/svg" '
            'font-size="11" font-family="system-ui, sans-serif">'
        ]
        parts += _axes(self, (x0, x1, y0, y1), sx, sy)
        # areas first, the top of the stack first: each is drawn from zero to its part's top,
        # opaque, so the next one down covers all but its own part (half the points of an
        # area drawn between its base and its top)
        areas = [s for s in self.series if s.kind == "area"][::-1]
        for series in areas + [s for s in self.series if s.kind != "area"]:
            parts.append(_draw(series, sx, sy))
        parts.append(_legend([s for s in self.series if s.name]))
        if not any(s.xs for s in self.series):
            parts.append(
                f'<text class="empty" x="{WIDTH / 2}" y="{self.height / 2}" '
                'text-anchor="middle" fill="#6b7385">nothing in this range</text>'
            )
        parts.append("</svg>")
        return "".join(parts)


def _axes(plot: Plot, box, sx, sy) -> list[str]:
    x0, x1, y0, y1 = box
    bottom, right = plot.height - BOTTOM, WIDTH - RIGHT
    out = ['<g class="axes" stroke="#e4e7ec">']
    for y in nice_ticks(y0, y1, 5):
        if y > y1:
            continue
        out.append(
            f'<line x1="{LEFT}" x2="{right}" y1="{_num(sy(y))}" y2="{_num(sy(y))}"/>'
            f'<text class="tick" x="{LEFT - 6}" y="{_num(sy(y) + 4)}" text-anchor="end" '
            f'stroke="none" fill="#6b7385">{_label(y)}</text>'
        )
    x_title = plot.x_title
    if plot.x_time:
        ticks, fmt = time_ticks(x0, x1)
        labels = [time_label(t, fmt) for t in ticks]
        if not fmt.startswith("%Y"):  # times of day: the day goes in the axis title
            x_title += ", " + time_label(x0, "%Y-%m-%d")
    else:
        ticks = [t for t in nice_ticks(x0, x1, 8) if x0 <= t <= x1]
        labels = [_label(t) for t in ticks]
    for x, text in zip(ticks, labels, strict=True):
        out.append(
            f'<line x1="{_num(sx(x))}" x2="{_num(sx(x))}" y1="{bottom}" y2="{bottom + 4}" '
            f'stroke="#9aa1ae"/><text class="tick" x="{_num(sx(x))}" y="{bottom + 16}" '
            f'text-anchor="middle" stroke="none" fill="#6b7385">{escape(text)}</text>'
        )
    out.append(
        f'<line x1="{LEFT}" x2="{right}" y1="{bottom}" y2="{bottom}" stroke="#9aa1ae"/>'
        f'<text class="axis-title" x="{LEFT + (right - LEFT) / 2}" y="{plot.height - 4}" '
        f'text-anchor="middle" stroke="none" fill="#1d2330">{escape(x_title)}</text>'
        f'<text class="axis-title" transform="translate(14 {TOP + (bottom - TOP) / 2}) '
        f'rotate(-90)" text-anchor="middle" stroke="none" fill="#1d2330">'
        f"{escape(plot.y_title)}</text></g>"
    )
    return out


def _symbol(symbol: str, x: float, y: float, size: float) -> str:
    """The path of one marker centred on (x, y)."""
    r = size / 2
    if symbol == "x":
        d, n = _num(size), _num(-size)
        return f"M{_num(x - r)} {_num(y - r)}l{d} {d}m0 {n}l{n} {d}"
    if symbol == "triangle":
        return f"M{_num(x)} {_num(y - r)}l{_num(r)} {_num(size)}h{_num(-size)}z"
    if symbol == "square":
        return f"M{_num(x - r)} {_num(y - r)}h{_num(size)}v{_num(size)}h{_num(-size)}z"
    # a circle: a zero-length stroke with round caps as wide as the marker
    return f"M{_num(x)} {_num(y)}h0"


def _marker_attrs(series: _Series, size: float) -> str:
    if series.symbol == "x":
        return f'fill="none" stroke="{series.color}" stroke-width="2.5"'
    if series.symbol == "circle":
        return (
            f'fill="none" stroke="{series.color}" stroke-width="{_num(size)}" '
            'stroke-linecap="round"'
        )
    return f'fill="{series.color}" stroke="none"'


def _draw(series: _Series, sx, sy) -> str:
    name = escape(series.name)
    points = list(zip(series.xs, series.ys, strict=True))
    if not points:
        return ""
    if series.kind == "line":
        path = "M" + "L".join(f"{_num(sx(x))} {_num(sy(y))}" for x, y in points)
        return (
            f'<path class="series line" data-series={quoteattr(series.name)} d="{path}" '
            f'fill="none" stroke="{series.color}" stroke-width="1.8"/>'
        )
    if series.kind == "markers":
        out = [f'<g class="series markers" data-series={quoteattr(series.name)}>']
        if len(points) > MAX_ELEMENTS:
            path = "".join(_symbol(series.symbol, sx(x), sy(y), series.size) for x, y in points)
            out.append(f'<path d="{path}" {_marker_attrs(series, series.size)}/>')
        else:
            for index, (x, y) in enumerate(points):
                size = series.sizes[index] if series.sizes else series.size
                text = series.texts[index] if series.texts else f"{name}: {_label(y)}"
                out.append(
                    f'<path class="point" d="{_symbol(series.symbol, sx(x), sy(y), size)}" '
                    f"{_marker_attrs(series, size)}><title>{escape(text)}</title></path>"
                )
        out.append("</g>")
        return "".join(out)
    base = series.base or [0.0] * len(points)
    if series.kind == "bars":
        xs = sorted(series.xs)
        gaps = [b - a for a, b in zip(xs, xs[1:], strict=False) if b > a]
        width = max(1.0, min(24.0, 0.8 * (sx(min(gaps)) - sx(0)) if gaps else 24.0))
        out = [
            f'<g class="series bars" data-series={quoteattr(series.name)} fill="{series.color}">'
        ]
        for index, (x, y) in enumerate(points):
            top, low = sy(base[index] + y), sy(base[index])
            text = series.texts[index] if series.texts else f"{name}: {_label(y)}"
            out.append(
                f'<rect class="bar" x="{_num(sx(x) - width / 2)}" y="{_num(top)}" '
                f'width="{_num(width)}" height="{_num(max(0.0, low - top))}">'
                f"<title>{escape(text)}</title></rect>"
            )
        out.append("</g>")
        return "".join(out)
    # area: from zero up to the part's top along the points, and back down to zero
    upper = "L".join(f"{_num(sx(x))} {_num(sy(base[i] + y))}" for i, (x, y) in enumerate(points))
    zero = _num(sy(0.0))
    first, last = _num(sx(points[0][0])), _num(sx(points[-1][0]))
    return (
        f'<path class="series area" data-series={quoteattr(series.name)} '
        f'd="M{first} {zero}L{upper}L{last} {zero}Z" fill="{series.color}" stroke="none"/>'
    )


def _legend(series: list[_Series], y: float = 14.0) -> str:
    out = ['<g class="legend">']
    x = float(LEFT)
    for s in series:
        swatch = (
            f'<path d="{_symbol(s.symbol, x + 6, y - 4, 9)}" {_marker_attrs(s, 9)}/>'
            if s.kind == "markers"
            else f'<rect x="{_num(x)}" y="{_num(y - 9)}" width="12" height="10" fill="{s.color}"/>'
        )
        out.append(
            f'<g class="legend-item">{swatch}<text class="legend-text" x="{_num(x + 16)}" '
            f'y="{_num(y)}" fill="#1d2330">{escape(s.name)}</text></g>'
        )
        x += 16 + 6.5 * len(s.name) + 18
    out.append("</g>")
    return "".join(out)


@dataclass
class Rows:
    """A strip of category rows over the same x axis as a ``Plot``: a mark at each x where a
    row holds (which tiers hold each step). ``render()`` draws it with the plot's x range
    taken from ``x_range``."""

    x_title: str
    rows: dict[str, list[float]] = field(default_factory=dict)
    texts: dict[str, list[str]] = field(default_factory=dict)

    def add(self, name: str, xs: Sequence[float], texts: Sequence[str] | None = None) -> None:
        self.rows[name] = list(xs)
        if texts is not None:
            self.texts[name] = list(texts)

    def render(self, *, label: str, x_range: tuple[float, float] | None = None) -> str:
        every = [x for xs in self.rows.values() for x in xs]
        x0, x1 = x_range or ((min(every), max(every)) if every else (0.0, 1.0))
        if x1 == x0:
            x0, x1 = x0 - 1, x1 + 1
        pad = (x1 - x0) * 0.02
        x0, x1 = x0 - pad, x1 + pad
        band = 22
        height = TOP + band * len(self.rows) + BOTTOM
        plot_w = WIDTH - LEFT - RIGHT

        def sx(x: float) -> float:
            return LEFT + (x - x0) / (x1 - x0) * plot_w

        parts = [
            f'<svg class="rows" viewBox="0 0 {WIDTH} {height}" role="img" '
            f'aria-label={quoteattr(label)} xmlns="http://www.w3.org/2000/svg" '
            'font-size="11" font-family="system-ui, sans-serif">'
        ]
        legend = []
        for index, (name, xs) in enumerate(self.rows.items()):
            color = PALETTE[(index + 2) % len(PALETTE)]
            y = TOP + band * index + band / 2
            parts.append(
                f'<text class="tick" x="{LEFT - 6}" y="{_num(y + 4)}" text-anchor="end" '
                f'fill="#6b7385">{escape(name)}</text>'
                f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{_num(y)}" y2="{_num(y)}" '
                'stroke="#e4e7ec"/>'
            )
            series = _Series(f"on {name}", "markers", xs, [0.0] * len(xs), color, symbol="square")
            series.texts = self.texts.get(name) or [f"on {name}: {_label(x)}" for x in xs]
            parts.append(_draw(series, sx, lambda _, y=y: y))
            legend.append(series)
        bottom = height - BOTTOM
        for x in [t for t in nice_ticks(x0, x1, 8) if x0 <= t <= x1]:
            parts.append(
                f'<text class="tick" x="{_num(sx(x))}" y="{bottom + 16}" text-anchor="middle" '
                f'fill="#6b7385">{_label(x)}</text>'
            )
        parts.append(
            f'<text class="axis-title" x="{LEFT + plot_w / 2}" y="{height - 4}" '
            f'text-anchor="middle" fill="#1d2330">{escape(self.x_title)}</text>'
        )
        parts.append(_legend(legend))
        parts.append("</svg>")
        return "".join(parts)
