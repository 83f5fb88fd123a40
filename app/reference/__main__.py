"""`python -m app.reference DIR`: the generated reference pages written under DIR (as `DIR/reference/*.md`)."""

from __future__ import annotations

import sys
from pathlib import Path

from app.reference.pages import pages

if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "reference-pages")
    for name, text in pages().items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path)
