"""Who may call what: the router's authentication rules, written once.

Pure Python with no imports from the rest of fastroute, so the data plane (which decides before
it reads a request body), the admin handlers and the supervisor's control listener share it.

Two layers, as the peers define them:

* ``--api-key KEY`` (data plane): every route needs ``Authorization: Bearer KEY`` except the
  open ones (probes and the model list, which load balancers and clients call without
  credentials). Without control-plane keys it also guards the worker-management routes.
* ``--control-plane-api-keys 'id:name:role:key' ...`` (control plane, smg's format; also
  ``$CONTROL_PLANE_API_KEYS``, several specs separated by commas or whitespace): when given, the
  worker-management routes accept only these keys. Role ``admin`` may call every one of them,
  role ``user`` may read (GET/HEAD) and gets 403 on a mutation. ``--api-key`` no longer opens
  them. ``/get_loads`` is one of them (an smg admin route). The reads smg serves publicly
  (``SHARED_READ_PATHS``, ``/health_generate``) take the data-plane key or any control-plane key.

Keys are kept only as SHA-256 digests and compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterable
from dataclasses import dataclass

# Every path the admin API answers, with the methods it takes (another method: 405); the proxy
# hands these and every /workers/<id> path to it. The one table: the admin handlers
# (control/admin.py), the proxy's dispatch and the metrics' path labels all read it.
ADMIN_METHODS: dict[bytes, tuple[str, ...]] = {
    b"/workers": ("GET", "POST"),
    b"/add_worker": ("POST",),
    b"/remove_worker": ("POST", "DELETE"),
    b"/list_workers": ("GET",),
    b"/get_loads": ("GET",),
    b"/flush_cache": ("POST",),
    b"/engine_metrics": ("GET",),
    b"/get_server_info": ("GET",),
    b"/server_info": ("GET",),
    b"/get_model_info": ("GET",),
    b"/model_info": ("GET",),
    b"/v1/models": ("GET",),
    b"/readiness": ("GET",),
    b"/health_generate": ("GET",),
    b"/dashboard": ("GET",),
    b"/dashboard/snapshot": ("GET",),
}
WORKER_ITEM_PREFIX = b"/workers/"  # /workers/<id>: GET, PUT, DELETE on one worker


def is_admin_path(path: bytes) -> bool:
    """Whether the admin API answers ``path`` (any method)."""
    return path in ADMIN_METHODS or path.startswith(WORKER_ITEM_PREFIX)


# Paths that stay open when an API key is configured.
OPEN_PATHS: frozenset[bytes] = frozenset({b"/health", b"/liveness", b"/readiness", b"/v1/models"})

# Worker management: the routes control-plane keys protect (plus every /workers/<id> path).
# /get_loads is one of smg's admin routes: control-plane keys guard it as they guard /workers.
MANAGEMENT_PATHS: frozenset[bytes] = frozenset(
    {
        b"/workers",
        b"/add_worker",
        b"/remove_worker",
        b"/list_workers",
        b"/flush_cache",
        b"/get_loads",
    }
)
# The live view on the main port (control/dashboard.py). The page holds no data and a browser
# cannot send a key when it opens a URL, so it is served to anyone; its snapshots (every
# worker's URL and load) are the admin's: an admin-role control-plane key, else --api-key,
# refused while the admin routes are closed; open only when no admin rule is configured.
DASHBOARD_PAGE = b"/dashboard"
DASHBOARD_SNAPSHOT = b"/dashboard/snapshot"
# Not a management route, yet it runs a generation on workers: it needs a key whenever any
# key is configured (AdminAuth.check).
HEALTH_GENERATE = b"/health_generate"
# Reads smg serves on its public routes. fastroute keeps them behind --api-key when one is set
# (stricter than smg: a caller without any key is refused), and then any control-plane key
# (admin or user) opens them as the data-plane key does.
SHARED_READ_PATHS: frozenset[bytes] = frozenset(
    {
        b"/get_server_info",
        b"/server_info",
        b"/engine_metrics",
        b"/get_model_info",
        b"/model_info",
    }
)
_READ_METHODS = frozenset({b"GET", b"HEAD"})
ROLES: tuple[str, ...] = ("admin", "user")

# Decisions: OK, or the status to answer with.
OK, UNAUTHORIZED, FORBIDDEN = 0, 401, 403


def bearer(key: str | None) -> bytes | None:
    """The expected Authorization value for ``key`` (None when no key is configured)."""
    return ("Bearer " + key).encode() if key else None


def matches(expected: bytes, got: bytes | None) -> bool:
    """Constant-time comparison of a presented credential with the expected one (None: absent)."""
    return got is not None and hmac.compare_digest(got, expected)


def authorized(expected: bytes | None, path: bytes, got: bytes | None) -> bool:
    """The ``--api-key`` rule: True when a request to ``path`` carrying Authorization ``got``
    may proceed."""
    if expected is None or path in OPEN_PATHS:
        return True
    return matches(expected, got)


def is_management(path: bytes) -> bool:
    return path in MANAGEMENT_PATHS or path.startswith(b"/workers/")


@dataclass(frozen=True)
class ControlPlaneKey:
    key_id: str
    name: str
    role: str
    digest: bytes  # sha256 of the secret


class ControlPlaneKeyError(ValueError):
    """A malformed --control-plane-api-keys entry (the message never contains the secret)."""


def parse_control_plane_keys(specs: Iterable[str]) -> tuple[ControlPlaneKey, ...]:
    """Parse ``id:name:role:key`` entries; the key may itself contain ':'."""
    out: list[ControlPlaneKey] = []
    seen: set[str] = set()
    for n, spec in enumerate(specs, 1):
        parts = spec.split(":", 3)
        if len(parts) != 4 or not parts[0] or not parts[3]:
            raise ControlPlaneKeyError(f"--control-plane-api-keys entry {n}: expected 'id:name:role:key'")
        key_id, name, role, secret = parts
        role = role.strip().lower()
        if role not in ROLES:
            raise ControlPlaneKeyError(
                f"--control-plane-api-keys entry {n} ({key_id}): its third field, the role, must "
                "be admin or user (the order is id:name:role:key; the value is not shown, in "
                "case a key was put there)"
            )
        if key_id in seen:
            raise ControlPlaneKeyError(f"--control-plane-api-keys: id {key_id!r} given twice")
        seen.add(key_id)
        out.append(ControlPlaneKey(key_id, name, role, hashlib.sha256(secret.encode()).digest()))
    return tuple(out)


def split_env_keys(value: str | None) -> list[str]:
    """``$CONTROL_PLANE_API_KEYS``: entries separated by commas or whitespace."""
    if not value:
        return []
    return [p for p in value.replace(",", " ").split() if p]


class AdminAuth:
    """The one rule for non-inference routes; built once per process from the config."""

    __slots__ = ("api_key", "keys", "closed")

    def __init__(self, api_key: str | None, keys: tuple[ControlPlaneKey, ...] = (), closed: bool = False) -> None:
        self.api_key = bearer(api_key)
        self.keys = keys
        # Worker management closed to everyone (fastroute sidecar without keys): FORBIDDEN with
        # no key, whatever the request carries. Keys, when given, open it as usual.
        self.closed = closed and self.api_key is None and not keys

    def principal(self, got: bytes | None) -> ControlPlaneKey | None:
        """The control-plane key whose secret ``got`` carries (every key is compared, so the
        time taken does not depend on which one matched)."""
        if got is None or not got.startswith(b"Bearer "):
            return None
        digest = hashlib.sha256(got[7:].strip()).digest()
        found = None
        for k in self.keys:
            if hmac.compare_digest(digest, k.digest):
                found = k
        return found

    def check(self, method: bytes, path: bytes, got: bytes | None) -> tuple[int, ControlPlaneKey | None]:
        """-> (OK | UNAUTHORIZED | FORBIDDEN, the control-plane key used, if any). FORBIDDEN
        without a key: the management routes are closed (``closed``)."""
        if path == DASHBOARD_PAGE:
            return OK, None
        if path == DASHBOARD_SNAPSHOT:
            return self._admin_only(got)
        if self.closed and is_management(path):
            return FORBIDDEN, None
        if self.keys and (path == HEALTH_GENERATE or (path in SHARED_READ_PATHS and self.api_key is not None)):
            # /health_generate (a real generation on a worker) is never open while any key is
            # configured; the shared reads need a key once --api-key is set. The data-plane
            # key or any control-plane key (these are reads) may call them.
            if self.api_key is not None and matches(self.api_key, got):
                return OK, None
            who = self.principal(got)
            return (OK, who) if who is not None else (UNAUTHORIZED, None)
        if self.keys and is_management(path):
            who = self.principal(got)
            if who is None:
                return UNAUTHORIZED, None
            if who.role != "admin" and method not in _READ_METHODS:
                return FORBIDDEN, who
            return OK, who
        return (OK if authorized(self.api_key, path, got) else UNAUTHORIZED), None

    def _admin_only(self, got: bytes | None) -> tuple[int, ControlPlaneKey | None]:
        """An admin's read: with control-plane keys only the admin role (a user key: FORBIDDEN),
        else ``--api-key``; FORBIDDEN while closed without keys; open with no rule at all."""
        if self.closed:
            return FORBIDDEN, None
        if self.keys:
            who = self.principal(got)
            if who is None:
                return UNAUTHORIZED, None
            return (OK if who.role == "admin" else FORBIDDEN), who
        return (OK if self.api_key is None or matches(self.api_key, got) else UNAUTHORIZED), None


_audit_log = logging.getLogger("fastroute.audit")


def audit(key: ControlPlaneKey | None, method: str, path: str, target: str, outcome: str, status: int) -> None:
    """One ``control_plane_audit`` line (--control-plane-audit-enabled): who, what, on which
    worker, how it ended. Never the secret: only the key's id and role."""
    _audit_log.info(
        "control_plane_audit key=%s role=%s method=%s path=%s target=%s outcome=%s status=%d",
        key.key_id if key is not None else "-",
        key.role if key is not None else "-",
        method,
        path,
        target,
        outcome,
        status,
        extra={
            "audit": True,
            "key_id": key.key_id if key is not None else None,
            "role": key.role if key is not None else None,
            "method": method,
            "path": path,
            "target": target,
            "outcome": outcome,
            "status": status,
        },
    )
