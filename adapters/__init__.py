"""Adapters: technologies behind the ports."""
