"""The engine itself: what the rest of the engine needs of one and how it gets one (`serving`: the
`Serving` a batch run and an online request talk to, from an `EngineFactory`), vLLM's side of it (`vllm_adapter`,
the only module that imports vLLM, with the request arguments each endpoint knows in `arguments`), the front-end
processes that spread vLLM's OpenAI serving layer (`frontends`), the thread and event loop everything that touches
the engine runs on (`bridge`), the LoRA adapters found by name as an engine checks them (`found_adapters`), and the
default model (`default_model`). The lowest room: it imports no other room of the engine, so a change to vLLM's
side reaches the rest only through `Serving`."""
