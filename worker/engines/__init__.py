"""Samplers, and only samplers: generate on a frozen copy in this process (hf_engine.py, with the folded
LoRA copy of folded.py) and a vLLM server of the job's own (vllm_engine.py, run under vllm_watchdog.py,
which imports nothing of this package). Each implements worker.batch.RolloutEngine. They import torch,
transformers, `worker.algos`, the model room and `service.core`, never the loops or the store."""
