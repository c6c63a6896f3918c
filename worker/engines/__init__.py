"""What samples rollouts: the RolloutEngine protocol, the batch records and log-probs (sampling.py),
generate on a frozen copy (HFEngine) and a vLLM server of the job's own (vllm_engine.py, run under
vllm_watchdog.py, which imports nothing of this package). They import torch, transformers, `worker.algos`
and `service.core`, never the store."""
