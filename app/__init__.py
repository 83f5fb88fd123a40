"""vbatch: a self-hosted, OpenAI-compatible Batch API over a live vLLM engine."""

__version__ = "0.1.0"
