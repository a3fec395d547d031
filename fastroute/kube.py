"""Kubernetes helpers shared by the config (validation at start-up) and the discovery provider:
label-selector parsing and where API credentials come from. Pure Python, no client library."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any

KUBE_TOKEN_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/token"
# One Kubernetes label-selector requirement: [!]key, key(=|==|!=)value, key (in|notin) (v, ...).
_SELECTOR_REQ = re.compile(
    r"\s*(?P<neg>!)?\s*(?P<key>[A-Za-z0-9][A-Za-z0-9./_-]*)\s*"
    r"(?:(?P<op>==|=|!=)\s*(?P<value>[A-Za-z0-9._-]*)|\s(?P<setop>in|notin)\s*\((?P<values>[^()]*)\))?\s*\Z"
)


def parse_selector(tokens: Iterable[str]) -> list[tuple[str, str, tuple[str, ...]]]:
    """Parse label-selector tokens (``app=a tier=b`` or ``"app=a,tier in (b,c)"``) into
    requirements ``(key, op, values)`` with op one of exists, !exists, =, !=, in, notin.
    Raises ValueError naming the bad requirement."""
    out = []
    for token in tokens:
        for part in re.split(r",(?![^()]*\))", token):
            if not part.strip():
                continue
            m = _SELECTOR_REQ.match(part)
            if m is None or (m["neg"] and (m["op"] or m["setop"])):
                raise ValueError(
                    f"{part.strip()!r} is not a label selector requirement "
                    "(key=value, key!=value, key, !key, key in (a,b), key notin (a,b))"
                )
            if m["setop"]:
                values = tuple(v.strip() for v in m["values"].split(",") if v.strip())
                out.append((m["key"], m["setop"], values))
            elif m["op"]:
                out.append((m["key"], "!=" if m["op"] == "!=" else "=", (m["value"],)))
            else:
                out.append((m["key"], "!exists" if m["neg"] else "exists", ()))
    return out


def kube_config_source(environ: Any = None) -> tuple[str, str | None] | None:
    """Where Kubernetes API credentials come from: ("incluster", None) inside a pod (service
    account token + KUBERNETES_SERVICE_HOST), ("kubeconfig", path) for $KUBECONFIG or
    ~/.kube/config, or None when there is none at all."""
    env = os.environ if environ is None else environ
    if env.get("KUBERNETES_SERVICE_HOST") and os.path.exists(KUBE_TOKEN_FILE):
        return "incluster", None
    paths = [p for p in env.get("KUBECONFIG", "").split(os.pathsep) if p]
    paths = paths or [os.path.join(os.path.expanduser("~"), ".kube", "config")]
    found = [p for p in paths if os.path.isfile(p)]
    return ("kubeconfig", os.pathsep.join(found)) if found else None


NO_KUBE_CONFIG = (
    "no Kubernetes configuration found: not running in a pod (KUBERNETES_SERVICE_HOST "
    "and a service-account token) and no kubeconfig ($KUBECONFIG or ~/.kube/config)"
)
