"""Request ids (dataplane/_ids.pyx): format, uniqueness, seeding, and a fresh sequence after fork."""

from __future__ import annotations

import os
import re

import pytest

from fastroute.dataplane import _ids
from fastroute.dataplane.wire import new_request_id

_HEX24 = re.compile(rb"[0-9a-f]{24}")


def test_an_id_is_the_prefix_and_24_lowercase_hex_characters() -> None:
    for prefix in (b"", b"req-", b"chatcmpl-", b"x" * 300):
        rid = _ids.request_id(prefix)
        assert rid.startswith(prefix) and len(rid) == len(prefix) + 24
        assert _HEX24.fullmatch(rid[len(prefix) :])


def test_ids_do_not_repeat_and_use_every_hex_digit_in_every_place() -> None:
    ids = [_ids.request_id(b"") for _ in range(20000)]
    assert len(set(ids)) == len(ids)
    for pos in range(24):  # 96 random bits: no position is stuck (e.g. a shift off by one)
        assert len({r[pos] for r in ids}) == 16, pos


def test_a_seed_fixes_the_sequence_and_the_os_seed_does_not() -> None:
    key = bytes(range(32))
    _ids.seed(key)
    a = [_ids.request_id(b"p") for _ in range(4)]
    _ids.seed(key)
    b = [_ids.request_id(b"p") for _ in range(4)]
    _ids.seed()
    c = [_ids.request_id(b"p") for _ in range(4)]
    assert a == b and a != c
    _ids.seed(bytes(32))  # a key of zeros still gives a well-spread state
    z = [_ids.request_id(b"") for _ in range(3)]
    assert len(set(z)) == 3 and all(r.count(b"0") < 8 for r in z)
    _ids.seed()
    with pytest.raises(ValueError):
        _ids.seed(b"short")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_draws_a_different_sequence_than_its_parent() -> None:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: write its next id and leave at once
        os.close(r)
        os.write(w, _ids.request_id(b""))
        os._exit(0)
    os.close(w)
    child = os.read(r, 64)
    os.close(r)
    os.waitpid(pid, 0)
    assert len(child) == 24 and child != _ids.request_id(b"")


def test_the_request_path_gives_its_route_prefix() -> None:
    assert _HEX24.fullmatch(new_request_id(b"/v1/chat/completions")[len(b"chatcmpl-") :])
    assert new_request_id(b"/not-a-route")[:4] == b"req-"
