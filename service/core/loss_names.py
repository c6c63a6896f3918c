"""The names of the policy losses and of their aggregations: the spec's choices and the keys of the
functions in worker/algos/losses.py. Plain typing, so worker/algos imports with torch alone
(bench/device_check.py runs on machines that have nothing else of the service)."""

from typing import Literal

LossName = Literal["grpo", "gspo", "cispo"]  # worker/algos/losses.py: one function each
LossAgg = Literal["token_mean", "seq_mean", "dr_grpo"]
