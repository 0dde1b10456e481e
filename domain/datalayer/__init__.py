"""The data layer: what keeps the endpoints' metrics and attributes current (data sources,
extractors, one collector per endpoint, the pool gauges)."""
