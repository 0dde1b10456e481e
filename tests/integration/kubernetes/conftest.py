"""The Kubernetes client every test here uses, against the module's ``server`` fixture."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes.client import ApiClient

from tests.support.kube_api import KubeApiServer, kube_client


@pytest.fixture
def api_client(server: KubeApiServer) -> Iterator[ApiClient]:
    with kube_client(server) as client:
        yield client
