"""Kubernetes adapter: discovery of InferencePool, Pods, InferenceObjectives and rewrites;
metrics auth (TokenReview, SubjectAccessReview); leader election (Leases)."""

from adapters.kubernetes.client import api_client_from_environment
from adapters.kubernetes.leader import LeaderElector
from adapters.kubernetes.metrics_auth import TokenReviewAuthorizer
from adapters.kubernetes.pods import ACTIVE_PORTS_ANNOTATION, validate_target_ports
from adapters.kubernetes.pool_source import POOL_GROUPS, InferencePoolSource
from adapters.kubernetes.selector_source import EndpointSelectorSource, parse_label_selector

__all__ = [
    "ACTIVE_PORTS_ANNOTATION",
    "POOL_GROUPS",
    "EndpointSelectorSource",
    "InferencePoolSource",
    "LeaderElector",
    "TokenReviewAuthorizer",
    "api_client_from_environment",
    "parse_label_selector",
    "validate_target_ports",
]
