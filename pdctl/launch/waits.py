"""How long pdctl waits on the processes it starts: the one statement of these defaults. The API, the engines,
the CLI (through pdctl.api) and the pytest plugin read them here; this module imports nothing."""

READY_TIMEOUT_S = 300.0  # every instance ready: vLLM loads the model, profiles and warms up before /health answers
STOP_GRACE_S = 15.0  # between SIGTERM and SIGKILL when stopping an instance
