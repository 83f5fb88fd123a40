"""Which batches this service runs, and when: the lease holder claims, renews and gives up the
batches it holds (`holder`), the watchdog ends the overdue ones (`watchdog`), and the scheduling loop gives each
held batch with no run a run and tells the fleet what this service is (`scheduler`); the three share the registry
`app.engine.batch.runs`. It may import every room below it; only `app.engine.service`, which wires the rooms, imports
it."""
