"""Open-loop load tests: locust users over gRPC (`locustfile.py`), Poisson arrivals, prompts, SLO
metrics and goodput (`metrics.py`), and rate sweeps with plots (`sweep.py`, `kvferry loadtest sweep`)."""
