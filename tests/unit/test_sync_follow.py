"""A tick's entries of the followed peers applied by ``View.follow`` (the next entry of a peer
holding a slot in one compiled call, ``_ledger.sync_entries``, the rest in Python) leave the view
as the Python reference below (the loop ``control/replica.py`` ran per entry before) does: the
same counts per peer and name, entry numbers, slots, touched names and skipped lines, over random
replies mixing the next entries, old ones, gaps, oversize entries, unknown and whole-read peers
and malformed lines."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastroute.control.replica import COUNT_LIMIT, MAX_ENTRY_BYTES
from fastroute.control.syncdelta import Names, View

NAMES = ["http://a:1@0", "http://a:1@1", "http://b:2", "x"]
PEERS = [b"p0", b"p1", b"p2", b"p3", b"stranger"]


class _Targets:
    target_info = [("w", r) for r in range(len(NAMES))]

    def target_name(self, t: int) -> str:
        return NAMES[t]


class _Table:
    generation = 0
    capacity = len(NAMES)


def _names() -> Names:
    names = Names()
    names.refresh(_Table(), _Targets())
    return names


LINE = st.one_of(
    st.tuples(
        st.sampled_from(NAMES + ["unknown"]),
        st.integers(-3, 9).map(str),
        st.integers(0, 9).map(str),
        st.sampled_from(["0", "1"]),
    ).map("\t".join),
    st.sampled_from(["garbage", "a\tb", f"x\t{COUNT_LIMIT}\t0\t0"]),
)
PAYLOAD = st.lists(LINE, max_size=4).map(lambda ls: "".join(f"{ln}\n" for ln in ls).encode())
ENTRY = st.tuples(
    st.sampled_from(PEERS),
    st.integers(0, 8),  # its number
    st.sampled_from([1, 1, 1, 2]),  # a payload, or its length only (oversize)
    PAYLOAD,
)
START = st.fixed_dictionaries(
    {
        p: st.tuples(st.one_of(st.none(), st.integers(0, 5)), st.one_of(st.none(), PAYLOAD), st.booleans())
        for p in PEERS[:4]
    }
)  # per peer: the number followed (None: not followed), a payload read whole before, read whole now


def _reference(view: View, reply: list, start: int, whole: set[bytes]) -> list[tuple]:
    skips: list[tuple] = []
    for i in range(start, len(reply), 4):
        pid, seq, kind, value = reply[i : i + 4]
        last = view.seq.get(pid)
        if pid in whole or last is None:
            continue
        n = int(seq)
        if n <= last:
            continue
        if kind == 2 or n != last + 1:
            if kind == 2:
                skips.append(("oversize", 1))
            del view.seq[pid]
            continue
        _, bad = view.set_lines(pid, value, COUNT_LIMIT)
        if bad:
            skips.append(("bad_line", bad))
        view.seq[pid] = n
    return skips


def _view(state: dict) -> View:
    view = View(_names())
    for pid, (seq, payload, _) in state.items():
        if payload is not None:
            view.set_all(pid, payload, COUNT_LIMIT)
        if seq is not None:
            view.seq[pid] = seq
    view.mark.fill(0)
    view.touched = []
    return view


def _state(view: View) -> tuple:
    per_peer = {pid: view.vals[:, slot].tolist() for pid, slot in view.slot.items()}
    return per_peer, dict(view.seq), sorted(view.touched), view.mark.tolist()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(START, st.lists(ENTRY, max_size=12), st.integers(0, 2))
def test_follow_applies_entries_as_the_python_loop_did(state, entries, lead):
    reply: list = [b"head"] * lead  # the entries start after the reply's other fields
    for pid, seq, kind, payload in entries:
        reply += [pid, str(seq).encode(), kind, payload if kind == 1 else len(payload) + MAX_ENTRY_BYTES]
    whole = {pid for pid, (_, _, now) in state.items() if now}
    want_view, got_view = _view(state), _view(state)
    want = _reference(want_view, reply, lead, whole)
    got = got_view.follow(reply, lead, whole, COUNT_LIMIT, MAX_ENTRY_BYTES)
    assert _state(got_view) == _state(want_view)
    total = {what: sum(n for w, n in want if w == what) for what in ("oversize", "bad_line")}
    assert {what: sum(n for w, _, n in got if w == what) for what in total} == total
    assert np.array_equal(got_view.vals, want_view.vals)
