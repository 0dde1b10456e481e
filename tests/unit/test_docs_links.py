"""Every relative link in the project's Markdown leads somewhere: the file exists, and a
``#heading`` anchor is one of its headings (a page renamed or a section reworded breaks the
links to it, and this says which)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.markdown import broken_links, heading_anchors, markdown_files

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("page", markdown_files(ROOT), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_links_of_a_page_resolve(page: Path) -> None:
    assert list(broken_links(page.read_text(), page.parent)) == []


def test_anchors_are_made_as_github_makes_them() -> None:
    text = (
        "# Running it in a cluster\n"
        "## `--workers` and `--redis-url`: what (not) to do\n"
        "## Several replicas (shared state on Redis)\n"
        "## Notes\n## Notes\n"
        "```sh\n# not a heading\n```\n"
    )
    assert heading_anchors(text) == {
        "running-it-in-a-cluster",
        "--workers-and---redis-url-what-not-to-do",
        "several-replicas-shared-state-on-redis",
        "notes",
        "notes-1",
    }


def test_a_broken_link_is_named(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n")
    text = (
        "[ok](other.md) [ok](other.md#other-page) [ok](#here) [web](https://example.com/x.md)\n"
        "# Here\n"
        "[gone](missing.md) [bad anchor](other.md#nope) [bad local](#there)\n"
        "`[in code](missing-too.md)`\n"
    )
    assert list(broken_links(text, tmp_path)) == ["missing.md", "other.md#nope", "#there"]
