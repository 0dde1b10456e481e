"""Worker processes: one supervisor, N full EPPs on one port (``--workers``)."""

__all__: list[str] = []
