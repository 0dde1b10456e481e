"""Envoy adapter: the ext_proc gRPC server, gRPC health, and TLS for them."""

from adapters.envoy.extproc import ExtProcServicer
from adapters.envoy.health import HealthServicer
from adapters.envoy.server import GrpcServers, ServerOptions
from adapters.envoy.tls import ServerCertificate, load_certificate, self_signed_certificate

__all__ = [
    "ExtProcServicer",
    "GrpcServers",
    "HealthServicer",
    "ServerCertificate",
    "ServerOptions",
    "load_certificate",
    "self_signed_certificate",
]
