"""Telemetry in one place: span and metric names, request metrics, OTel and Prometheus set-up."""
