"""The in-tree flow-control policy plugins, one per module (each with ``register``)."""
