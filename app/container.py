"""The composition root: wires settings, adapters and the domain."""

from __future__ import annotations

from dependency_injector import containers, providers

from adapters.envoy.server import GrpcServers
from adapters.envoy.tls import ServerCertificate, load_certificate, self_signed_certificate
from adapters.jsoncodec.orjson_codec import OrjsonCodec
from app.settings import Settings
from domain.datastore.static_source import StaticEndpointSource, parse_endpoint_list
from domain.datastore.store import Datastore
from domain.requestcontrol.director import Director
from ports.endpoints import EndpointSource

__all__ = ["Container", "build_container"]


def _certificate(settings: Settings) -> ServerCertificate | None:
    if not settings.secure_serving:
        return None
    if settings.cert_path is not None:
        return load_certificate(settings.cert_path)
    return self_signed_certificate()


def _endpoint_source(settings: Settings) -> EndpointSource:
    return StaticEndpointSource(parse_endpoint_list(settings.static_endpoints))


class Container(containers.DeclarativeContainer):
    """Providers for everything the process runs. Tests override any of them."""

    settings = providers.Dependency(instance_of=Settings)
    codec = providers.Singleton(OrjsonCodec)
    datastore = providers.Singleton(Datastore)
    endpoint_source = providers.Singleton(_endpoint_source, settings)
    processor = providers.Singleton(
        Director,
        datastore=datastore,
        codec=codec,
        subset_filter=providers.Callable(lambda s: not s.disable_endpoint_subset_filter, settings),
    )
    certificate = providers.Singleton(_certificate, settings)
    servers = providers.Singleton(
        GrpcServers,
        processor=processor,
        host=settings.provided.bind_address,
        grpc_port=settings.provided.grpc_port,
        health_port=settings.provided.grpc_health_port,
        certificate=certificate,
        health_on_extproc_port=settings.provided.health_checking,
    )


def build_container(settings: Settings) -> Container:
    container = Container()
    container.settings.override(settings)
    return container
