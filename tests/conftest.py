"""Suite-wide collection order: the slowest single test file first."""

from __future__ import annotations

import pytest

#: Test files that take minutes on a fresh machine (the image test builds the image from
#: nothing there): collected first, so that under `make test` one worker starts on them while
#: the others share the rest, instead of one worker starting on them last.
_FIRST = ("tests/image/",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(_FIRST))
