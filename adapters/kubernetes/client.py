"""How the process reaches the Kubernetes API: in-cluster service account, or a kubeconfig."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import cast

from kubernetes import config as kube_config
from kubernetes.client import ApiClient, Configuration

__all__ = ["api_client_from_environment"]

_LOG = logging.getLogger(__name__)

# The loaders are untyped in the ``kubernetes`` package.
_new_client_from_config = cast(Callable[..., ApiClient], kube_config.new_client_from_config)
_load_incluster_config = cast(Callable[..., None], kube_config.load_incluster_config)


def api_client_from_environment(kubeconfig: str | os.PathLike[str] | None = None) -> ApiClient:
    """An ``ApiClient`` for the cluster the process runs in.

    With ``kubeconfig``, that file (its current context). Otherwise the in-cluster service
    account when running in a pod, else ``$KUBECONFIG`` or ``~/.kube/config``. Raises
    ``kubernetes.config.ConfigException`` when none is usable. Blocking: call at startup.
    """
    if kubeconfig is not None:
        _LOG.info("Kubernetes API: kubeconfig %s", kubeconfig)
        return _new_client_from_config(config_file=os.fspath(kubeconfig))
    try:
        configuration = Configuration()
        _load_incluster_config(client_configuration=configuration)
    except kube_config.ConfigException:
        _LOG.info("Kubernetes API: not in a cluster, using the default kubeconfig")
        return _new_client_from_config()
    _LOG.info("Kubernetes API: in-cluster service account, %s", configuration.host)
    return ApiClient(configuration)
