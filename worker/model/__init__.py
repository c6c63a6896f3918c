"""The model: loading a policy and its tokenizer (loading.py), its checkpoints (checkpoints.py) and its
teacher-forced forward, the per-token log-probs every loss reads (forward.py, with the shared-prompt forward
of prefix.py). They import torch, transformers, peft, `worker.algos`, `worker.machine` and `service.core`,
never the loops, the engines or the store."""
