"""The dashboard's SVG charts (zephon.ui.svg) on their own: round ticks, time labels, text
escaped, and a size bounded by the number of series however many points they hold."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ElementTree
from datetime import UTC, datetime

from hypothesis import assume, given
from hypothesis import strategies as st

from zephon.ui.svg import MAX_ELEMENTS, Plot, Rows, nice_ticks, time_label, time_ticks


def elements(svg: str) -> int:
    return len(ElementTree.fromstring(svg).findall(".//*"))


@given(
    st.floats(-1e9, 1e9, allow_nan=False),
    st.floats(1e-6, 1e9, allow_nan=False),
)
def test_ticks_are_round_evenly_spaced_and_inside_the_range(low, width):
    assume(width > 1e-6 * abs(low))  # a range a float of that size can tell apart
    high = low + width
    ticks = nice_ticks(low, high)
    assert 2 <= len(ticks) <= 13
    step = ticks[1] - ticks[0]
    power = 10 ** math.floor(math.log10(step))
    slack = 4 * math.ulp(max(abs(low), abs(high)))  # what a float of that size can hold
    assert any(abs(step - m * power) <= 1e-9 * step + slack for m in (1, 2, 5, 10)), step
    assert all(low - step * 1e-6 <= t <= high + step * 1e-6 for t in ticks)


def test_time_ticks_label_by_their_interval():
    at = datetime(2026, 12, 3, 16, 12, 38, 950_000, tzinfo=UTC).timestamp()
    ticks, fmt = time_ticks(at, at + 0.3)
    assert [time_label(t, fmt) for t in ticks][:3] == [
        "16:12:38.950",
        "16:12:39.000",
        "16:12:39.050",
    ]
    ticks, fmt = time_ticks(at, at + 5 * 3600)
    assert [time_label(t, fmt) for t in ticks] == ["17:00", "18:00", "19:00", "20:00", "21:00"]
    ticks, fmt = time_ticks(at, at + 30 * 86400)
    assert time_label(ticks[0], fmt) == "2026-12-10"


def test_a_plot_escapes_every_text_and_is_well_formed_xml():
    plot = Plot("time & <step>", "step", x_time=True)
    plot.line("<script>alert(1)</script>", [1e9, 1e9 + 5], [1, 2], texts=["a<b", 'c"d'])
    svg = plot.render(label='say "hi" <there>')
    root = ElementTree.fromstring(svg)
    assert root.get("aria-label") == 'say "hi" <there>'
    texts = ["".join(node.itertext()) for node in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "<script>alert(1)</script>" in texts
    assert any(t.startswith("time & <step>, 2001-09-09") for t in texts)
    assert "<script>" not in svg and "alert(1)" in svg


def test_many_points_draw_a_bounded_number_of_elements():
    few, many = Plot("step", "s"), Plot("step", "s")
    for plot, n in ((few, MAX_ELEMENTS), (many, 100_000)):
        xs = list(range(n))
        plot.line("loss", xs, [x % 7 for x in xs])
        plot.stacked(["write_s", "commit_s"], xs, [[0.1] * n, [0.2] * n])
        plot.markers("emergency save", xs, xs, symbol="x")
    # a marker and a bar per point, each with its hover text, up to MAX_ELEMENTS points
    assert elements(few.render(label="few")) > 4 * MAX_ELEMENTS
    svg = many.render(label="many")
    assert elements(svg) < 100, "beyond MAX_ELEMENTS a series is one element"
    assert len(re.findall(r'class="series area"', svg)) == 2


def test_rows_mark_each_step_a_category_holds_on_a_shared_axis():
    rows = Rows("step")
    rows.add("local", [8, 10])
    rows.add("save_dir", [2, 4, 8, 10])
    svg = rows.render(label="tiers", x_range=(2, 10))
    root = ElementTree.fromstring(svg)
    titles = ["".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}title")]
    assert titles == ["on local: 8", "on local: 10"] + [f"on save_dir: {s}" for s in (2, 4, 8, 10)]


def test_an_empty_plot_says_so():
    plot = Plot("step", "seconds")
    plot.stacked(["write_s"], [], [[]])
    assert "nothing in this range" in plot.render(label="empty")
