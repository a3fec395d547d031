"""Every ``protocol.md N.M`` a comment cites must be a section of docs/protocol.md, so a renumbered
or deleted section fails here instead of leaving comments that point nowhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# "protocol.md 3.3", "protocol.md 7.2-7.4", "protocol.md sections 2, 3.3, 3.6," (continued on the
# next line of the comment, hence the newline and '#' in the class).
_CITE = re.compile(r"protocol\.md(?: sections?)?((?:[\s#]*\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?,?)+)")
_NUM = re.compile(r"(\d+)(?:\.(\d+))?(?:-(\d+)(?:\.(\d+))?)?")


def _sections() -> set[str]:
    text = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", text, re.M))


def _citations() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for top in ("fastroute", "tests", "bench"):
        for path in (ROOT / top).rglob("*"):
            if path.suffix not in (".py", ".pyx", ".pxd", ".pyi", ".md") or not path.is_file():
                continue
            if path == Path(__file__).resolve():  # this file's own examples are not citations
                continue
            for m in _CITE.finditer(path.read_text(encoding="utf-8")):
                for major, minor, major2, minor2 in _NUM.findall(m.group(1)):
                    cited = {f"{major}.{minor}" if minor else major}
                    if minor and minor2 and major2 == major:  # a range such as 6.2-6.6
                        cited |= {f"{major}.{i}" for i in range(int(minor), int(minor2) + 1)}
                    out.setdefault(str(path.relative_to(ROOT)), set()).update(cited)
    return out


def test_protocol_doc_has_every_cited_section() -> None:
    sections = _sections()
    cites = _citations()
    assert cites, "no protocol.md citation found: the pattern no longer matches the comments"
    missing = {f: sorted(c - sections) for f, c in cites.items() if c - sections}
    assert not missing, missing


def test_protocol_doc_keeps_its_numbering() -> None:
    # The numbering is the public contract of the document (comments cite it); the top-level
    # sections stay, in order (13, the engines' KV events, came last).
    text = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
    tops = [int(n) for n in re.findall(r"^## (\d+)\. ", text, re.M)]
    assert tops == list(range(14))
