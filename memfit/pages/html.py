"""One self-contained HTML page: the building blocks every ``memfit report`` page is made of.

A page is HTML written here (every piece of text escaped), plus one JSON block of data that the inline script
``assets/memfit.js`` turns into charts with uPlot (vendored in ``assets/``, MIT licence beside it) and into sortable
tables. Scripts and styles are inline, so the file opens offline and mails as one attachment; no network request
is made. Untrusted text (snapshot frame names, file names, config values) reaches the page only escaped: by
``esc`` in the HTML, as ``\\u003c``-escaped JSON in the data block, and through ``textContent`` in the script.

Known limitations: charts need JavaScript; tables, numbers and segment maps are plain HTML and read without it.
"""

from __future__ import annotations

import html
import json
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from memfit.errors import write_output

ASSETS = resources.files("memfit.pages") / "assets"
STYLES = ("uPlot.min.css", "memfit.css")
SCRIPTS = ("uPlot.iife.min.js", "memfit.js")


def esc(value: Any) -> str:
    """Text as HTML, quotes included (safe in elements and attribute values)."""
    return html.escape(str(value), quote=True)


def _finite(value: Any) -> Any:
    """NaN and infinities become None (JSON has neither); containers are walked."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def script_json(data: Any) -> str:
    """``data`` as JSON that cannot end its ``<script>`` element or open a comment in it."""
    text = json.dumps(_finite(data), separators=(",", ":"), allow_nan=False)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


@dataclass(frozen=True)
class Cell:
    """A table cell: its text, and the value a sort by its column uses (default: the text)."""

    text: str
    sort: float | str | None = None
    title: str | None = None


def table(
    header: list[str] | None,
    rows: list[list[Any]],
    *,
    sortable: bool = True,
    table_id: str | None = None,
    row_ids: list[str] | None = None,
    caption: str | None = None,
    css_class: str = "",
) -> str:
    """An HTML table; numbers (or ``Cell`` sort values) sort numerically when a header is clicked."""
    attrs = f' id="{esc(table_id)}"' if table_id else ""
    cls = ("sortable" if sortable else "plain") + (f" {css_class}" if css_class else "")
    out = [f'<table class="{cls}"{attrs}>']
    if caption:
        out.append(f"<caption>{esc(caption)}</caption>")
    if header:
        out.append("<thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr></thead>")
    out.append("<tbody>")
    for i, row in enumerate(rows):
        rid = f' data-row="{esc(row_ids[i])}"' if row_ids else ""
        cells = []
        for value in row:
            cell = value if isinstance(value, Cell) else Cell(_text(value), value if _is_number(value) else None)
            sort = "" if cell.sort is None else f' data-sort="{esc(cell.sort)}"'
            title = "" if cell.title is None else f' title="{esc(cell.title)}"'
            align = "" if _NUMERIC.match(cell.text) or not cell.text else ' class="t"'
            cells.append(f"<td{align}{sort}{title}>{esc(cell.text)}</td>")
        out.append(f"<tr{rid}>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


_NUMERIC = re.compile(r"^[-+]?[\d,]*\.?\d+(e[-+]?\d+)?( ?(GiB|MiB|KiB|%|s|x))?\+?$")
"""A cell that reads as a number (with a unit) is aligned right, text left."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value)


def key_values(pairs: list[tuple[str, Any]]) -> str:
    """A two-column table of names and values (not sortable)."""
    return table(None, [[k, v] for k, v in pairs], sortable=False, css_class="kv")


def pre(text: str) -> str:
    return f"<pre>{esc(text)}</pre>"


def paragraph(text: str, cls: str = "") -> str:
    return f'<p class="{esc(cls)}">{esc(text)}</p>' if cls else f"<p>{esc(text)}</p>"


def _short(value: float | None) -> float | None:
    """A chart value to 6 significant digits (a chart shows no more; the page stays small)."""
    return None if value is None else float(f"{value:.6g}")


@dataclass(frozen=True)
class Series:
    """One line (or bars, or points) of a chart; ``values`` aligned with the chart's x values (None: a gap)."""

    label: str
    values: list[float | None]
    color: str
    kind: str = "line"  # line | step | bars | points
    dash: bool = False
    scale: str = "y"  # "y" or "y2" (a second axis on the right)


@dataclass
class Page:
    """Sections of escaped HTML and the data its charts are drawn from."""

    title: str
    kind: str  # run | snapshot | plan | bench: memfit.js's page-specific behaviour
    subtitle: str = ""
    sections: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=lambda: {"charts": {}})

    def section(self, heading: str, *parts: str, section_id: str | None = None) -> None:
        sid = f' id="{esc(section_id)}"' if section_id else ""
        self.sections.append(f"<section{sid}><h2>{esc(heading)}</h2>{''.join(parts)}</section>")

    def chart(
        self,
        chart_id: str,
        title: str,
        x: list[float],
        x_label: str,
        series: list[Series],
        y_label: str,
        *,
        y2_label: str | None = None,
        hover: str | None = None,
        x_time: bool = False,
        height: int = 300,
        order: list[int] | None = None,
        x_names: list[str] | None = None,
    ) -> str:
        """A placeholder the script fills with a uPlot chart (drag to zoom, double-click to reset); ``hover``
        names a memfit.js handler that describes the point under the cursor in the box below the chart; ``order``
        maps a point to its item where the x values are sorted (a scatter of bench cells); ``x_names`` names
        categories at x = 0, 1, 2, ..."""
        self.data["charts"][chart_id] = {
            "title": title,
            "x": x,
            "x_label": x_label,
            "x_time": x_time,
            "y_label": y_label,
            "y2_label": y2_label,
            "series": [{**vars(s), "values": [_short(v) for v in s.values]} for s in series],
            "hover": hover,
            "height": height,
            "order": order,
            "x_names": x_names,
        }
        box = f'<div class="hover" id="{esc(chart_id)}-hover"></div>' if hover else ""
        return f'<figure><div class="chart" id="{esc(chart_id)}"></div>{box}</figure>'

    def render(self) -> str:
        styles = "\n".join((ASSETS / name).read_text(encoding="utf-8") for name in STYLES)
        scripts = "\n".join(
            (ASSETS / name).read_text(encoding="utf-8").replace("</script", "<\\/script") for name in SCRIPTS
        )
        head = f"<h1>{esc(self.title)}</h1>" + (
            f'<p class="subtitle">{esc(self.subtitle)}</p>' if self.subtitle else ""
        )
        return (
            "<!DOCTYPE html>\n"
            '<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
            "script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:\">"
            f"<title>{esc(self.title)}</title><style>{styles}</style></head>"
            f'<body data-kind="{esc(self.kind)}"><header>{head}</header><main>{"".join(self.sections)}</main>'
            "<footer>memfit report: one offline page; charts by uPlot (MIT licence, "
            "Leon Sorokin), drawn from the data in this file.</footer>"
            f'<script type="application/json" id="memfit-data">{script_json(self.data)}</script>'
            f"<script>{scripts}</script></body></html>\n"
        )


def write_page(page: Page, path: Path) -> Path:
    """Write the page atomically (a partial file never stays behind).

    Raises:
        UserError: the directory does not exist or cannot be written.
    """
    path = Path(path)
    write_output(path, page.render(), "choose another path for the page")
    return path
