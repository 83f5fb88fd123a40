"""The web console: batches, one batch, submit, files and the engine, in a browser, served by the same app.

Server-rendered pages (Jinja2) and one small hand-written script (`static/console.js`: polling of page fragments,
the upload form, a two-series SVG chart). No build step and nothing vendored: every byte the browser runs is in
this package and short enough to read, and nothing is fetched from the internet at run time. The console calls
the same domain functions as the API, under the caller's owner id, so it sees exactly what the API would show
that key.
"""

from pathlib import Path

CONSOLE_STATIC = Path(__file__).parent / "static"
