"""The contract the API and the workers share, and nothing else: job specs and their parts, reward
specs, settings, data-file parsing, the artifact store, the queue contract, path resolution, and the
records the loops hand to the store.

The rule: `service.core` imports neither torch, nor FastAPI, nor the rest of `service`, nor `worker`
(tests/test_architecture.py reads the imports and checks it). Both sides stand on it: the API and the
store beside the workers, the CLI on top of all three.
"""
