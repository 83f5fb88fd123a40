"""The docs' generated reference pages: every setting, command and flag, metric, HTTP route and error code, read from
the code that defines them, so that the pages cannot drift from it. `make docs` builds them into the site through
its hook (`docs/hooks/reference.py`); `python -m app.reference DIR` writes them to DIR to read or diff."""
