"""Port implementations for tests, with inspectable state (not mocks)."""

from tests.fakes.processor import DEFAULT_ENDPOINT, FakeExchange, FakeProcessor

__all__ = ["DEFAULT_ENDPOINT", "FakeExchange", "FakeProcessor"]
