"""The EndpointPickerConfig: YAML schema, parameter validation, quantities and the loader."""

from app.config.loader import (
    DEFAULT_CONFIG,
    FEATURE_GATES,
    REFERENCE_DEFAULT_CONFIG_TEXT,
    ConfigError,
    DataLayerSpec,
    LoadedConfig,
    SourceSpec,
    load_config,
)
from app.config.parameters import ParameterError, validate_parameters
from app.config.quantity import parse_quantity, quantity_value
from app.config.schema import EndpointPickerConfigSpec, FlowControlSpec

__all__ = [
    "DEFAULT_CONFIG",
    "FEATURE_GATES",
    "REFERENCE_DEFAULT_CONFIG_TEXT",
    "ConfigError",
    "DataLayerSpec",
    "EndpointPickerConfigSpec",
    "FlowControlSpec",
    "LoadedConfig",
    "ParameterError",
    "SourceSpec",
    "load_config",
    "parse_quantity",
    "quantity_value",
    "validate_parameters",
]
