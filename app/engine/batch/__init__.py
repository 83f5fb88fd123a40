"""One batch's run, from its input to its ending: resolved once into a `Run` (`run`) and told top to bottom by
`runner` as calls in order: its input validated and indexed (`intake`), its lines planned (`ordering`) or cut into
shards for other workers (`shards`), fed, their results appended to part files (`parts`) and checkpointed on each
tick (`checkpoints`), the lines an engine death took re-run (`suspects`), its speed told (`meter`), and ended at one
exit, `ending.end`, which chooses the ending from what the run tells it (a `RunOutcome`); every other module reports
facts. What every run shares is its `Context` (`context`), the batches this service holds are in one registry
(`runs`), and `vbatch run` runs one file alone through the same parts (`offline`). It may import every room below it
(`inference`, `telemetry`, `sharing`, `online`)."""
