"""The router: the public gRPC API (`server.py`) and, on the same asyncio loop, the OpenAI-compatible
HTTP API and Prometheus metrics (`openai_api.py`, `openai_protocol.py`, `metrics.py`, `http_server.py`).

`server.Router` runs each request through collaborators it builds, each an object with its own state
and verbs: `admission.Admission` (the cheap checks in `limits.py`, the in-flight table, tokenizing,
validation, block keys and the pool lookup: `admit`), `slo.SloPredictor` (each request's TTFT and TPOT
predicted, a predicted miss refused or deprioritized), `dispatch.PrefillDispatch` (the prefill: KV-aware
routing in `prefix_routing.py`, the call, failover by `failover.Failover`), `relay.DecodeRelay` (the
decode stream to the client over `decode_link.py`, resumed on another worker if one breaks; colocated),
`sequences.Sequences` (n sequences of one prompt), `resume.Resumes` (a stream whose router went away)
and `release.Releases` (what an ended request leaves behind; aborts). A request in flight is an
`inflight.Inflight`. Around them: the worker registry (`directory.py`), the traffic record for the
planner (`traffic.py`) and a client (`client.py`)."""
