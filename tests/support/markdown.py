"""Markdown links as GitHub resolves them: relative paths and ``#heading`` anchors."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

__all__ = ["broken_links", "heading_anchors", "markdown_files"]

_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
_INLINE_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")


def _prose(text: str) -> str:
    """``text`` without its fenced blocks and code spans (links there are examples)."""
    return _SPAN.sub("", _FENCE.sub("", text))


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of ``text``: lower case, punctuation but ``-``
    and ``_`` dropped, each space a ``-``, a repeated one suffixed ``-1``, ``-2``, ..."""
    anchors: set[str] = set(_HTML_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        title = _INLINE_LINK.sub(r"\1", heading).replace("`", "").lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def broken_links(text: str, base: Path) -> Iterator[str]:
    """The links of ``text`` (Markdown in directory ``base``) to a local file that does not
    exist, or to a heading its Markdown file does not have."""
    for link in dict.fromkeys(_LINK.findall(_prose(text))):
        if "://" in link or link.startswith("mailto:"):
            continue
        path, _, anchor = link.partition("#")
        target = base / path if path else None
        if target is not None and not target.exists():
            yield link
        elif anchor and (target is None or target.suffix == ".md"):
            headings = heading_anchors(text if target is None else target.read_text())
            if anchor not in headings:
                yield link


def markdown_files(root: Path) -> list[Path]:
    """The project's Markdown files: tracked sources, not environments or build output."""
    skip = {".venv", "build", "node_modules", ".git"}
    return sorted(
        path
        for path in root.rglob("*.md")
        if not skip.intersection(path.relative_to(root).parts)
        and not any(part.startswith(".") for part in path.relative_to(root).parts)
    )
