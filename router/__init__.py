"""The router: the public gRPC API (`server.py`) and, on the same asyncio loop, the OpenAI-compatible
HTTP API and Prometheus metrics (`openai_api.py`, `openai_protocol.py`, `metrics.py`); validation,
tokenization, admission, routing over the worker registry (`directory.py`), and a client (`client.py`)."""
