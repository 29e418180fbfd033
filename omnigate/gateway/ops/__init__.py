"""Running the server: Prometheus metrics, logging, graceful drain, event-loop lag and the plain HTTP routes
(liveness, readiness, models, voices, metrics)."""
