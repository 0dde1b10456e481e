"""In-tree scheduling plugins: one plugin per module."""
