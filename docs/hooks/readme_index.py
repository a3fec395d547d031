"""MkDocs hook: the README is the site's front page (index.md), so its links are checked with
the rest. The README links into docs/ from the repository root; the page sits inside docs/, so
the ``docs/`` prefix of each relative link is dropped. A README link that leaves docs/ stays as
it is, and the strict build reports it: the README links only to documentation pages."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

_LINK = re.compile(r"\]\(docs/")


def on_files(files: Files, config: Any) -> Files:
    readme = Path(config["config_file_path"]).parent / "README.md"
    text = _LINK.sub("](", readme.read_text(encoding="utf-8"))
    files.append(File.generated(config, "index.md", content=text))
    return files
