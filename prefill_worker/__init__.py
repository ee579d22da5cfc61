"""The prefill worker: the `PrefillWorker` gRPC service (`worker.py`) and its side of the KV hand-off
(`handoff.py`: prefix lookup -> prefix pull -> prefilling -> KV write). The engine itself is
`kvferry.engine`; the process runtime both workers share is `kvferry.worker`."""
