"""The engine core every process that runs the model shares: requests and sampling parameters, the
block manager and prefix cache, the scheduler, the model runner over the paged KV cache, `LLMEngine`
and the engine thread (`EngineLoop`). It imports the model and the kernels, never a worker, the
router, the launchers or the CLI."""
