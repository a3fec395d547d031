"""`fastroute --help` as a newcomer reads it (the real command): the common flags come first in a
group of their own, the peers' compatibility groups last, and every flag is still listed once."""

from __future__ import annotations

import re
import subprocess
import sys

from fastroute.config.cli import COMMON_FLAGS


def _help() -> str:
    out = subprocess.run([sys.executable, "-m", "fastroute", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_common_flags_first_compatibility_last() -> None:
    text = _help()
    headers = [ln[:-1] for ln in text.splitlines() if re.match(r"^[A-Za-z][^ ].*:$", ln) and not ln.startswith("usage")]
    assert headers[0] == "Common flags", headers
    assert headers[-3:] == [
        "Ignored for compatibility",
        "Accepted: fastroute already does this",
        "Refused (not implemented)",
    ]
    common = text.split("Common flags:", 1)[1].split("\noptions:", 1)[0]
    listed = re.findall(r"^  (--[a-z0-9-]+)", common, re.M)
    assert listed == list(COMMON_FLAGS)
    lines = text.splitlines()
    policy = next(i for i, ln in enumerate(lines) if ln.startswith("  --policy "))
    assert policy < 40, policy  # was line 95, below the listener and security groups


def test_every_flag_is_listed_once() -> None:
    flags = re.findall(r"^  (--[a-z0-9-]+)", _help(), re.M)
    dup = sorted({f for f in flags if flags.count(f) > 1})
    assert not dup, dup
    for f in ("--enable-trace", "--otlp-traces-endpoint", "--host", "--decode-kv-fit", "--jemalloc-prof-dir"):
        assert f in flags, f
