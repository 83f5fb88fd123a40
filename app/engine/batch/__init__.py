"""One batch's run, from its input to its ending: resolved once into a `Run` (`run`) and run top to
bottom by `runner`: its input validated and indexed (`intake`), its lines planned (`ordering`) or cut into shards
for other workers (`shards`), fed, their results appended to part files and checkpointed (`parts`), its speed told
(`meter`), and ended (`ending`, which decides every ending). What every run shares is its `Context` (`context`), the
batches this service holds are in one registry (`runs`), and `vbatch run` runs one file alone through the same
parts (`offline`). It may import every room below it (`inference`, `telemetry`, `sharing`, `online`)."""
