"""Adversarial probes: hostile peers and message sequences, one module per finding."""
