"""Every relative link and image of the README and docs/ resolves (the file, and the heading
an anchor names, as GitHub makes its anchors), and every figure in docs/ is shown on some
page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to
    hyphens."""
    text = FENCE.sub("", page.read_text())
    heads = re.findall(r"^#{1,6} +(.+?) *$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(FENCE.sub("", page.read_text())) if "://" not in t]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_image_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT)}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with the anchor #{anchor}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_every_figure_in_docs_is_shown_somewhere():
    shown = {(page.parent / t.partition("#")[0]).resolve() for page in PAGES for t in links(page)}
    unshown = [p.name for p in sorted((ROOT / "docs").glob("*.png")) if p.resolve() not in shown]
    assert not unshown, f"figures no page shows: {unshown}"


def test_a_broken_image_path_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("![figure](docs/figure.png) [ok](page.md#a-heading)\n\n## A heading\n")
    (tmp_path / "figure.png").write_bytes(b"")
    assert links(page) == ["docs/figure.png", "page.md#a-heading"]
    assert not (page.parent / "docs/figure.png").exists()
    assert anchors(page) == {"a-heading"}
