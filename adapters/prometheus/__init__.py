"""Prometheus adapter: scraping model servers (and, later, serving the EPP's own metrics)."""
