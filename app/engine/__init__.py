"""The engine side of vbatch: one vLLM engine per process, the batches it runs, the online requests it answers.

`app.engine.service` (`EngineService`) is its entry and wires the rest, which lives in rooms, each a package that
imports only from the rooms below it (lowest first; `tests/unit/test_code_shape.py` guards the order):

- `inference`: the engine itself, vLLM behind `Serving` (the only room that imports vLLM);
- `telemetry`: vbatch's Prometheus series and the engine's steps;
- `sharing`: how batch lines and online requests share the engine (the in-flight window, the pacing, the feed);
- `online`: online requests, forwarded or not, the API's view of the engine, estimates;
- `batch`: one batch's run, from its input to its ending;
- `scheduling`: which batches this service holds and runs (leases, the scheduling loop, the watchdog).

The words they use, each with the module that owns it: docs/explanation/glossary.md.
"""
