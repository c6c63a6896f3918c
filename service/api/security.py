"""What every response carries for the browser, and what the access log must not."""

from __future__ import annotations

import logging
import re

DASHBOARD_CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
                 "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
API_PREFIXES = ("/v1/", "/docs", "/redoc", "/openapi.json", "/healthz", "/readyz", "/metrics")


def security_headers(path: str) -> dict[str, str]:
    """Headers for every response; the dashboard's pages also get a CSP without inline script
    (the API's /docs page loads Swagger UI with an inline script, so it is only kept unframed)."""
    headers = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"}
    dashboard = not path.startswith(API_PREFIXES)
    headers["Content-Security-Policy"] = DASHBOARD_CSP if dashboard else "frame-ancestors 'none'"
    return headers


class RedactTokens(logging.Filter):
    """Access logs print the request line: keep stream tokens (the only credential a URL may
    carry) out of them."""

    PATTERN = re.compile(r"(access_token=)[^&\s]*")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self.PATTERN.sub(r"\1[redacted]", a) if isinstance(a, str) else a
                                for a in record.args)
        return True


_access_log = logging.getLogger("uvicorn.access")
if not any(isinstance(f, RedactTokens) for f in _access_log.filters):
    _access_log.addFilter(RedactTokens())
