"""Every relative link in README.md, docs/*.md and benchmarks/README.md leads somewhere: the file exists and,
where the link names an #anchor, the target has that heading. The README is a front page that sends readers
into docs/, so a page moved or a heading renamed must fail here rather than in a newcomer's browser."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def prose(markdown: str) -> str:
    """The text outside fenced blocks: a heading or a link written in one is an example."""
    return FENCE.sub("", markdown)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped but hyphens and underscores, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower()).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose(page.read_text()).splitlines():
        if match := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    return [
        target
        for target in LINK.findall(CODE_SPAN.sub("", prose(page.read_text())))
        if not re.match(r"[a-z][a-z0-9+.-]*:", target)
    ]


def broken(page: Path) -> list[str]:
    problems = []
    for target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            shown = resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved
            problems.append(f"{target}: no file {shown}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{target}: no heading #{anchor} in {resolved.name}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken(page) == []


def test_a_broken_link_or_anchor_is_caught(tmp_path):
    (tmp_path / "there.md").write_text("# A heading, with `code`\n\n## Again\n## Again\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#a-heading-with-code) [dup](there.md#again-1) ![img](missing.png)\n"
        "[bad anchor](there.md#nowhere) [self](#local) `[in code](gone.md)`\n\n# Local\n"
    )
    assert [problem.split(":")[0] for problem in broken(page)] == ["missing.png", "there.md#nowhere"]


def test_the_readme_stays_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 320


def test_the_field_reports_named_in_the_summary_are_the_pages_headings():
    from exlnb.experiments.record import FIELD_REPORTS

    headings = re.findall(r"^## (\d)\. (.+?)(?: \(.*\))?$", (ROOT / "docs" / "field-reports.md").read_text(), re.M)
    assert {int(n): subject for n, subject in headings} == FIELD_REPORTS
