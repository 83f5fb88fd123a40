"""What vbatch counts and measures: its Prometheus series beside vLLM's own (`metrics`: counted where
things happen, read at scrape time; the API and the webhook sender count into it too) and the engine's steps as vLLM
reports them, with the fitted cost of a step that the window and the pacing read (`steps`). It may import
`inference` (a step is `serving.EngineStep`), no other room."""
