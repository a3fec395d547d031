"""The admin API's authentication rule, written once.

Used by the proxy (before an admin request's body is read), by the admin handlers and by the
supervisor's control listener (whose per-run secret is compared with :func:`matches`). Pure Python, no imports from the rest of fastroute.

Under ``--api-key`` every route needs ``Authorization: Bearer <key>`` except the open ones:
the liveness/readiness probes and the model list, which load balancers and clients call without
credentials. The comparison is constant-time.
"""
from __future__ import annotations

import hmac

# Paths that stay open when an API key is configured.
OPEN_PATHS: frozenset[bytes] = frozenset({b"/health", b"/liveness", b"/readiness", b"/v1/models"})


def bearer(key: str | None) -> bytes | None:
    """The expected Authorization value for ``key`` (None when no key is configured)."""
    return ("Bearer " + key).encode() if key else None


def matches(expected: bytes, got: bytes | None) -> bool:
    """Constant-time comparison of a presented credential with the expected one (None: absent)."""
    return got is not None and hmac.compare_digest(got, expected)


def authorized(expected: bytes | None, path: bytes, got: bytes | None) -> bool:
    """True when a request to ``path`` carrying Authorization ``got`` may proceed."""
    if expected is None or path in OPEN_PATHS:
        return True
    return matches(expected, got)
