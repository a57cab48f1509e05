"""Prometheus series of the service layer: per model, per node, and the watchdog's."""
