"""Metrics (Prometheus), per-request timing, traces (OpenTelemetry) and JSON logs."""
