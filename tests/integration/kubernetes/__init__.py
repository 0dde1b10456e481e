"""Kubernetes discovery against a loopback API server, with the real ``kubernetes`` client."""
