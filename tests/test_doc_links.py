"""Every relative link in README.md and docs/*.md resolves (issue 24 item 23): the file exists
and, for ``file.md#anchor``, the file has a heading with that anchor (GitHub's slugs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def without_code(text: str) -> str:
    """The page with fenced code blocks and inline code removed (links there are not links)."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in re.sub(r"^(```|~~~).*?^\1", "", path.read_text(encoding="utf-8"), flags=re.S | re.M).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out.update(re.findall(r'<a\s+(?:name|id)="([^"]+)"', path.read_text(encoding="utf-8")))
    return out


def links(path: Path) -> list[str]:
    return [
        t
        for t in LINK.findall(without_code(path.read_text(encoding="utf-8")))
        if not re.match(r"^[a-z][a-z0-9+.-]*:", t)
    ]  # (http:, https:, mailto:)


def test_the_slugs_are_githubs() -> None:
    assert slug("Config validation with paths") == "config-validation-with-paths"
    assert slug("`tempering show RECIPE`") == "tempering-show-recipe"
    assert slug("ChatML: SmolLM2 with tools") == "chatml-smollm2-with-tools"
    assert slug("Datasets, and what a factory returns") == "datasets-and-what-a-factory-returns"


def test_the_link_finder_finds_links() -> None:
    page = '[a](docs/x.md) `[b](no.md)` ![c](img.png "t") [d](https://e.org) [e](#top)\n```\n[f](g.md)\n```\n'
    found = [t for t in LINK.findall(without_code(page)) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]
    assert found == ["docs/x.md", "img.png", "#top"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor '#{anchor}' in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
