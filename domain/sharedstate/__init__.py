"""State shared by several EPP processes, as the domain sees it: a remote prefix index
behind a deadline with the local index as fallback, and the in-memory ``SharedLoad``
implementations (one process alone, or several sharing a board in tests)."""

from domain.sharedstate.load import BoardMember, LoadBoard, LocalSharedLoad
from domain.sharedstate.resilient_index import ResilientPrefixIndex

__all__ = ["BoardMember", "LoadBoard", "LocalSharedLoad", "ResilientPrefixIndex"]
