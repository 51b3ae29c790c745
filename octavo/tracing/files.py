"""Write a report's PNG and/or HTML files (the PNG is drawn once and embedded into the HTML)."""
from __future__ import annotations

import logging
from pathlib import Path

from octavo.errors import OctavoError
from octavo.tracing.html import write_html
from octavo.tracing.plot import render_png_bytes
from octavo.tracing.report import TraceReport

log = logging.getLogger(__name__)


def write_outputs(report: TraceReport, *, png: str | Path | None = None, html: str | Path | None = None,
                  x_axis: str = "step") -> list[Path]:
    """Write the requested files; returns their paths. Without matplotlib the HTML has no figure. X_AXIS: "step"
    or "time" (wall seconds: idle time between requests shows)."""
    written: list[Path] = []
    image: bytes | None = None
    if png or html:
        try:
            image = render_png_bytes(report.rows, report.spans, report.labels, report.title, x_axis)
        except OctavoError:
            if png:
                raise
            log.warning("matplotlib is not installed: the HTML report has tables but no figure")
    if png and image is not None:
        path = Path(png)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(image)
        written.append(path)
    if html:
        written.append(write_html(report, html, image))
    return written
