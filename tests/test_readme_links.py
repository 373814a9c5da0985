"""README's links point inside the repository (issue 31, first-run friction: it linked a design file outside
it): every relative link target and every `docs/...` / `*.md` file it names exists in the checkout."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_links_resolve_in_the_repository():
    text = (ROOT / "README.md").read_text()
    targets = {m.split("#", 1)[0] for m in re.findall(r"\]\(([^)\s]+)\)", text)
                if not m.startswith(("http://", "https://", "mailto:", "#"))}
    targets |= set(re.findall(r"`(docs/[\w./-]+\.md)`", text))
    assert "docs/DESIGN.md" in targets
    missing = sorted(t for t in targets if not (ROOT / t).exists())
    assert not missing, f"README links to files not in the repository: {missing}"
    assert "/work/" not in text and "shared/DESIGN" not in text
