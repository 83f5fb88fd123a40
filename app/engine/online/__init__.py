"""What the API asks of the engine as it happens, outside any batch: an online request from the API's
event loop to the engine thread's and its answer back (`requests`), or from an API replica with no engine to a
worker that serves its model (`forward`); what the API and the console see of the engine, this process's or the
workers' (`view`); and a batch's estimate before it exists (`estimating`). It may import `inference`, `telemetry`
and `sharing`."""
