"""Prometheus metrics of the control plane (`GET /metrics`, docs/observability.md): the database's
view read at scrape time (service.py), the API process's own counters (registry.py), and who may
scrape (access.py, shared with the inference server)."""
