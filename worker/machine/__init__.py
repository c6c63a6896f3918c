"""What the worker runs on: its accelerators (inventory.py), their kind, peak and precision (hardware.py),
memory budgets and what a step will need (memory.py), the allocator training processes run with
(allocator.py) and the fingerprint of a run's machine, software and model (fingerprint.py). They import
torch, `worker.algos`, the model room (a model's source) and `service.core`, never the loops, the engines or
the store."""
