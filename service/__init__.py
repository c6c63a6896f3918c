"""The service: the HTTP API (api/, app.py), the SQL store (store/), the CLI (cli/), the dashboard, and the
contract it shares with the workers (core/). Only the CLI imports `worker` (tests/test_architecture.py)."""
