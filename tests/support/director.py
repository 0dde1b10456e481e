"""A Director wired the way the process wires it, from an EndpointPickerConfig."""

from __future__ import annotations

import random

from adapters.jsoncodec.orjson_codec import OrjsonCodec
from adapters.xxhash.block_hasher import XxhashBlockHasher
from app.config.loader import load_config
from app.plugins import build_registry
from domain.datastore.objectives import ObjectiveStore
from domain.datastore.store import Datastore
from domain.plugins.handle import Handle
from domain.plugins.state import RequestStates
from domain.prefixcache.index import InMemoryPrefixIndex
from domain.requestcontrol.director import Director, RequestControl
from domain.scheduling.scheduler import Scheduler
from ports.observer import NoopObserver, Observer

__all__ = ["configured_director"]


def configured_director(
    datastore: Datastore,
    config_text: str | None = None,
    *,
    seed: int | None = 0,
    objectives: ObjectiveStore | None = None,
    explain_decisions: bool = False,
    emit_endpoint_scores: bool = False,
    include_entry_points: bool = False,
    observer: Observer | None = None,
) -> Director:
    """The plugins of ``config_text`` (the default config when None): the in-tree types,
    and those of installed ``epp.plugins`` entry points with ``include_entry_points``."""
    codec = OrjsonCodec()
    rng = random.Random(seed)
    handle = Handle(
        codec=codec,
        hasher=XxhashBlockHasher(),
        prefix_index=InMemoryPrefixIndex(),
        datastore=datastore,
        rng=rng,
        observer=observer if observer is not None else NoopObserver(),
    )
    loaded = load_config(
        config_text,
        registry=build_registry(include_entry_points=include_entry_points),
        handle=handle,
    )
    control = RequestControl(
        parser=loaded.parser,
        scheduler=Scheduler(loaded.profile_handler, loaded.profiles),
        saturation_detector=loaded.saturation_detector,
        data_producers=loaded.data_producers,
        admitters=loaded.admitters,
        placement_claimers=loaded.placement_claimers,
        pre_request=loaded.pre_request,
        response_header=loaded.response_header,
        response_body=loaded.response_body,
        explain_decisions=explain_decisions,
        emit_endpoint_scores=emit_endpoint_scores,
    )
    return Director(
        datastore=datastore,
        codec=codec,
        control=control,
        objectives=objectives,
        states=RequestStates(),
        rng=rng,
        observer=observer,
    )
