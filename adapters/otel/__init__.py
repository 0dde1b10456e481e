"""OpenTelemetry adapter: traces of the EPP's request path."""
