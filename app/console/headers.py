"""The headers every console response carries: a strict Content-Security-Policy, no framing, no sniffing, no
referrer beyond this origin.

The pages satisfy the policy as they are: no inline script, style or event handler (`console.js` and `console.css`
are the only script and style), every fetch and form goes to this origin, nothing is loaded from elsewhere. A
stray injected `<script>` or `style=` would not run.
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import Message, Send

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",  # the browser's own favicon request; the console has no images
        "connect-src 'self'",
        "form-action 'self'",
        "base-uri 'none'",
        "frame-ancestors 'none'",
    ]
)
CONSOLE_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
}


def with_console_headers(send: Send) -> Send:
    """`send`, adding the console's headers to the response's start: whatever answers (the route, an error handler,
    a redirect, a static file's 304), the headers go out."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = MutableHeaders(scope=message)
            for name, value in CONSOLE_HEADERS.items():
                headers[name] = value
        await send(message)

    return sending
