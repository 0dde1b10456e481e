"""``python -m app.config``: the config compatibility tables of ``docs/drop-in.md``."""

from __future__ import annotations

from app.config.compatibility import render_markdown
from app.plugins import build_registry

__all__: list[str] = []

if __name__ == "__main__":
    print(render_markdown(build_registry(include_entry_points=False).types()), end="")
