"""In-tree request-control plugins: one plugin per module."""
