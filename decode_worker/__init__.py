"""The decode worker: the `DecodeWorker` gRPC service (`worker.py`) and its side of the KV hand-off
(`handoff.py`: prealloc -> transfer -> the engine). The engine itself is `kvferry.engine`; the process
runtime both workers share is `kvferry.worker`."""
