"""The README is a front door and the manual lives in docs/: every relative link resolves, every #anchor names a
heading of its page, and no page cites a file that is not in the repository. The benchmark and reliability pages stay
short; the dated records in docs/records/ keep how each figure was obtained, and every benchmark JSON has one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECORDS = sorted((REPO / "docs" / "records").glob("*.md"))
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *RECORDS]
PAGES_OF_DOCS = sorted((REPO / "docs").glob("*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", flags=re.DOTALL | re.MULTILINE)


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(match) for match in re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE)}


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


def test_slugs_follow_github():
    assert slug("Evaluation on the CPU (SmolLM2-135M)") == "evaluation-on-the-cpu-smollm2-135m"
    assert slug("Settings `STAPOConfig` refuses") == "settings-stapoconfig-refuses"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):
            continue
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if not destination.exists():
            broken.append(
                f"{target}: no file {destination.relative_to(REPO) if REPO in destination.parents else destination}"
            )
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading with anchor #{anchor} in {destination.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_no_page_cites_a_file_outside_the_repository():
    for page in PAGES:
        assert "DESIGN.md" not in page.read_text(), f"{page.name} cites DESIGN.md, which is not in the repository"


def test_the_readme_is_a_front_door():
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) <= 12 * 1024
    for page in PAGES_OF_DOCS:
        assert f"(docs/{page.name})" in readme, f"the README links no docs/{page.name}"


@pytest.mark.parametrize("page", PAGES_OF_DOCS, ids=lambda page: page.name)
def test_every_page_of_the_docs_reads_in_a_few_minutes(page):
    assert len(page.read_bytes()) < 20 * 1024, f"{page.name}: split it by topic, or move history into docs/records/"


RECORD_INDEXES = [REPO / "docs" / name for name in ("benchmarks.md", "studies.md", "reliability.md")]


def test_every_record_is_linked_from_the_benchmark_studies_or_reliability_page():
    linked = {(page.parent / target.partition("#")[0]).resolve() for page in RECORD_INDEXES for target in links(page)}
    assert len(RECORDS) >= 20
    assert not [record.name for record in RECORDS if record.resolve() not in linked]


def test_every_record_opens_with_its_date():
    for record in RECORDS:
        title, opening = record.read_text().split("\n\n", 2)[:2]
        assert title.startswith("# "), record.name
        assert re.search(r"\b\d{4}-\d{2}-\d{2}\b", opening), f"{record.name}: the first line says when it was measured"


def test_every_benchmark_json_is_named_by_a_record():
    records = "\n".join(record.read_text() for record in RECORDS)
    results = sorted((REPO / "docs" / "benchmarks").glob("*.json"))
    assert not [path.name for path in results if f"docs/benchmarks/{path.name}" not in records]
