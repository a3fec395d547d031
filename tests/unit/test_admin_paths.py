"""The admin paths are one table (auth.ADMIN_METHODS): the admin API has a handler for each
path in it and for no other, takes the methods it lists, the proxy hands exactly these paths
(and /workers/<id>) to it, and each gets a metrics path label of its own."""

from __future__ import annotations

from fastroute.auth import ADMIN_METHODS, is_admin_path
from fastroute.control.admin import AdminAPI
from fastroute.dataplane.routes import INFERENCE
from fastroute.dataplane.telemetry import path_label


def test_every_admin_path_has_one_handler_with_the_tables_methods() -> None:
    handled = set(AdminAPI._ROUTES) | {"/workers"}  # /workers is answered with /workers/<id>
    assert handled == {p.decode() for p in ADMIN_METHODS}
    for path, (methods, fn) in AdminAPI._ROUTES.items():
        assert methods == ADMIN_METHODS[path.encode()], path
        assert callable(fn)


def test_the_proxy_sends_admin_paths_and_only_those_to_the_admin_api() -> None:
    for path in ADMIN_METHODS:
        assert is_admin_path(path)
    assert is_admin_path(b"/workers/0b6f0d5e-2c1d-4c6e-9a57-1f1e0e4f9a11")
    for path in (*INFERENCE, b"/health", b"/liveness", b"/metrics", b"/workersx", b"/"):
        assert not is_admin_path(path), path


def test_each_admin_path_is_its_own_metrics_label() -> None:
    for path in ADMIN_METHODS:
        assert path_label(path) == path.decode()
    assert path_label(b"/workers/abc") == "/workers/{worker_id}"
    assert path_label(b"/not-a-route") == "other"
