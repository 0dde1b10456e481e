"""In-tree data-layer plugins (sources' extractors): one plugin per module."""
