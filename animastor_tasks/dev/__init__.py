"""Development tooling: local stores, the one process supervisor (demo, tests, benchmarks), the demo,
the reference inference server and the sample book. Nothing here runs in production."""
