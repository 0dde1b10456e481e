"""Tests of the domain's shared state: the resilient prefix index and the in-memory loads."""
