"""The engine side of vbatch: the vLLM adapter (the only place that imports vLLM) and the batch loop."""
