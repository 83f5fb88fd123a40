"""How batch lines and online requests share the one engine: the engine as both see it, one executor
that survives its deaths (`recovering`), lines run through it with a bounded number in flight (`execution`), the
in-flight window that gives way to online requests (`window`), the pace of the batch's prompt tokens while online
requests are about (`pacing`), and whose batch hands its lines to the engine next (`feed`). It may import
`inference` and `telemetry`; it knows no batch's row, file or ending."""
