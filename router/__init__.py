"""The router: the public gRPC API (`server.py`) and, on the same asyncio loop, the OpenAI-compatible
HTTP API and Prometheus metrics (`openai_api.py`, `openai_protocol.py`, `metrics.py`, `http_server.py`).

`server.Router` is assembled from five parts, one module each: `admission.py` (the cheap checks in
`limits.py`, tokenizing, validation: `admit`), `slo.py` (SLO admission: each request's TTFT and TPOT
predicted, a predicted miss refused or deprioritized), `dispatch.py` (the prefill: KV-aware routing in
`prefix_routing.py`, the call, failover in `failover.py`), `relay.py` (the decode stream to the client,
resumed on another worker if one breaks) and `sequences.py` (n sequences of one prompt). Around them:
the worker registry (`directory.py`), the traffic record for the planner (`traffic.py`) and a client
(`client.py`)."""
