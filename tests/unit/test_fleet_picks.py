"""power_of_two at fleet scale: a pick reads the two rows it samples and no other.

The proof is the memory protection of the real table pages: in a child process every page of a
4,096-candidate table is made unreadable except those holding the two rows the NumPy twin says
the pick will sample; a kernel that scans the candidates faults (SIGSEGV), one that samples
returns the twin's pick and books it.  The sampled pair stays uniform over the eligible
candidates, falling back to a scan when draws keep missing (differential, against the twin)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fastroute.core import _policy
from fastroute.core import reference as R
from fastroute.core.table import COL_CIRCUIT, COL_HEALTHY, COL_IN_FLIGHT, COL_POLLED_AT, COL_POLLED_TOKENS, NCOLS
from fastroute.names import LOAD_METRIC_CODE

CHILD = textwrap.dedent(
    """
    import ctypes, mmap, sys
    import numpy as np
    from fastroute.core import _ledger, reference as R
    from fastroute.core.table import (COL_HEALTHY, COL_IN_FLIGHT, COL_POLLED_AT, COL_POLLED_TOKENS,
                                      NCOLS, NHDR)

    seed, metric, sick = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    n, gap = 4096, 64  # a candidate every 64 rows: 12 KiB apart, each on pages of its own
    rows, page = n * gap, mmap.PAGESIZE
    buf = mmap.mmap(-1, rows * NCOLS * 8)
    tab = np.frombuffer(buf, dtype=np.int64).reshape(rows, NCOLS)
    header = np.zeros(NHDR, dtype=np.int64)
    cands = np.arange(n, dtype=np.int64) * gap
    rs = np.random.default_rng(seed)
    tab[cands, COL_HEALTHY] = 1
    tab[cands[rs.choice(n, sick, replace=False)], COL_HEALTHY] = 0  # some not eligible
    tab[cands, COL_POLLED_AT] = 1
    tab[cands, COL_POLLED_TOKENS] = rs.integers(0, 1000, n)
    # the rows the twin's draws look at (the two it keeps, and those it drew and found not
    # eligible), and its pick
    drawn, eligible = set(), R._row_eligible
    R._row_eligible = lambda tab, t: drawn.add(int(t)) or eligible(tab, t)
    rng = R.Rng(seed)
    i = R._sample_eligible(tab, cands, -1, rng)
    j = R._sample_eligible(tab, cands, i, rng)
    R._row_eligible = eligible
    assert i >= 0 and j >= 0, "the draws missed: choose another seed"
    want = R.power_of_two(tab, cands, metric, R.Rng(seed))
    picker = _ledger.Picker(tab, header, "power_of_two", metric, seed=seed)
    picker.set_candidates(cands)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    base = tab.ctypes.data
    assert libc.mprotect(base, rows * NCOLS * 8, 0) == 0  # PROT_NONE: every row unreadable
    assert len(drawn) < 16, drawn
    for t in drawn:
        lo = (base + int(t) * NCOLS * 8) // page * page
        hi = -(-(base + (int(t) + 1) * NCOLS * 8) // page) * page
        assert libc.mprotect(lo, hi - lo, 3) == 0  # PROT_READ | PROT_WRITE: the drawn rows only
    lease = picker.acquire(100)
    got, held = lease.target, int(tab[lease.target, COL_IN_FLIGHT])
    lease.release()
    print(got, want, held, int(tab[got, COL_IN_FLIGHT]))
    """
)


@pytest.mark.parametrize("metric", ["tokens", "requests"])
@pytest.mark.parametrize("seed,sick", [(1, 0), (2, 0), (3, 1024), (4, 2048)])
def test_a_pick_reads_only_the_two_rows_it_samples(metric, seed, sick):
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(seed), metric, str(sick)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"the pick read rows it did not sample (status {proc.returncode}): {proc.stderr}"
    got, want, held, after = map(int, proc.stdout.split())
    assert got == want and held == 1 and after == 0


def test_sampled_pairs_are_uniform_over_the_eligible():
    """Half the candidates ineligible: every eligible one is drawn into the pair equally often
    (the tokens metric with equal loads keeps the first draw, so picks count first draws)."""
    n = 16
    tab = np.zeros((n, NCOLS), dtype=np.int64)
    tab[:, COL_HEALTHY] = 1
    tab[:, COL_POLLED_AT] = 1
    tab[::2, COL_CIRCUIT] = 1  # open: not eligible
    s = np.array([7], dtype=np.uint64)
    picks = [_policy.power_of_two(tab, np.arange(n), LOAD_METRIC_CODE["tokens"], s) for _ in range(40_000)]
    counts = np.bincount(picks, minlength=n)
    assert counts[::2].sum() == 0
    share = counts[1::2] / len(picks)
    assert np.all(np.abs(share - 1 / 8) < 0.01), share


@pytest.mark.parametrize("seed", range(30))
def test_compiled_matches_the_twin_whatever_share_is_eligible(seed):
    rs = np.random.default_rng(seed)
    n = int(rs.integers(2, 200))
    tab = np.zeros((n, NCOLS), dtype=np.int64)
    # from almost none to all eligible: the draws miss often, sometimes every try (the scan)
    tab[:, COL_HEALTHY] = rs.random(n) < [0.02, 0.1, 0.5, 1.0][seed % 4]
    tab[:, COL_POLLED_AT] = np.where(rs.random(n) < 0.8, 1, -1)
    tab[:, COL_POLLED_TOKENS] = rs.integers(0, 5, n)
    cands = np.sort(rs.choice(n, int(rs.integers(1, n + 1)), replace=False)).astype(np.int64)
    for metric in ("tokens", "requests"):
        s, ref = np.array([seed], dtype=np.uint64), R.Rng(seed)
        for _ in range(200):
            got = _policy.power_of_two(tab, cands, LOAD_METRIC_CODE[metric], s)
            assert got == R.power_of_two(tab, cands, metric, ref)
            if got >= 0:
                tab[got, COL_IN_FLIGHT] += 1
