"""What a step held in memory: this process's resident set now and at its peak since the step
began, and on a GPU the peak the caching allocator handed out.

Linux keeps a process's peak resident set (VmHWM) and resets it when "5" is written to
/proc/self/clear_refs, so a step's own peak is measurable in a worker that outlives many jobs.
Elsewhere (no /proc) the CPU figures are absent rather than wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
GB = 2**30


@dataclass(frozen=True)
class MemoryUse:
    rss_gb: float | None  # resident set at the end of the step
    peak_rss_gb: float | None  # highest resident set since `reset_peak`
    cuda_peak_gb: float | None  # highest allocated CUDA memory since `reset_peak` (None off the GPU)
    # highest memory the CUDA caching allocator held from the driver meanwhile: what the card must have; its
    # excess over the allocated peak is the allocator's slack and fragmentation (expandable_segments shrinks it)
    cuda_reserved_peak_gb: float | None = None

    def metrics(self) -> dict[str, float]:
        named = {"memory/rss_gb": self.rss_gb, "memory/peak_rss_gb": self.peak_rss_gb,
                 "memory/cuda_peak_gb": self.cuda_peak_gb, "memory/cuda_reserved_peak_gb": self.cuda_reserved_peak_gb}
        return {k: v for k, v in named.items() if v is not None}


def _status_kb(*fields: str) -> dict[str, int]:
    try:
        lines = _STATUS.read_text().splitlines()
    except OSError:
        return {}
    got = {}
    for line in lines:
        key, _, rest = line.partition(":")
        if key in fields:
            got[key] = int(rest.split()[0])
    return got


def reset_peak(device: torch.device) -> None:
    """Start measuring a new peak (the step's), for the process and the device."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        pass  # not Linux, or /proc read-only: the peak is then the process's since it started
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def measure(device: torch.device) -> MemoryUse:
    kb = _status_kb("VmRSS", "VmHWM")
    on_gpu = device.type == "cuda"
    cuda = torch.cuda.max_memory_allocated(device) / GB if on_gpu else None
    reserved = torch.cuda.max_memory_reserved(device) / GB if on_gpu else None
    rss, hwm = kb.get("VmRSS"), kb.get("VmHWM")
    return MemoryUse(rss_gb=None if rss is None else rss * 1024 / GB,
                     peak_rss_gb=None if hwm is None else hwm * 1024 / GB, cuda_peak_gb=cuda,
                     cuda_reserved_peak_gb=reserved)


# -- whether to recompute activations: chosen from what a micro-batch would keep against the memory there is --

# A micro-batch's activations may take this share of the budget before checkpointing is switched on: the rest
# is the weights, the rollout copy, AdamW's state, the allocator's slack and the other jobs on the worker.
ACTIVATION_SHARE = 0.5


@dataclass(frozen=True)
class CheckpointPlan:
    """Whether a job recomputes its decoder layers' activations in backward, and why."""

    checkpointing: bool
    activations_gb: float  # what one micro-batch keeps for backward without checkpointing (estimated)
    budget_gb: float | None  # the memory a step may plan on (None: unknown, checkpointing stays off)
    asked: bool  # the spec said (model.gradient_checkpointing), the estimate did not decide

    def metrics(self) -> dict[str, float]:
        return {"memory/checkpointing": float(self.checkpointing), "memory/activations_est_gb": self.activations_gb}

    def event(self) -> tuple[str, dict]:
        """The `memory_plan` event's message and data."""
        if self.asked:
            why = "as the spec asks"
        elif self.budget_gb is None:
            why = "the available memory is unknown here"
        else:
            why = (f"a micro-batch's activations, about {self.activations_gb:.2f} GB, are "
                   f"{'over' if self.checkpointing else 'within'} {ACTIVATION_SHARE:.0%} of the "
                   f"{self.budget_gb:.1f} GB budget")
        state = "on" if self.checkpointing else "off"
        return (f"gradient checkpointing {state}: {why}",
                {"checkpointing": self.checkpointing, "activations_gb": self.activations_gb,
                 "budget_gb": self.budget_gb, "asked": self.asked})


# The sampler folds LoRA into its own copy of the adapted weights (worker/engines/folded.py) when the copy takes
# at most this share of the budget: a tenth of a budget is spare; beyond it, memory decides over speed.
FOLD_SHARE = 0.1


@dataclass(frozen=True)
class FoldPlan:
    """Whether the sampler decodes through weights with the LoRA adapter folded in, and why."""

    fold: bool
    copy_gb: float  # what the sampler's copy of the adapted weights takes
    budget_gb: float | None

    def describe(self) -> str:
        if self.budget_gb is None:
            return "the sampler runs the adapter unfolded: the available memory is unknown here"
        state = "folds the adapter into" if self.fold else "runs the adapter unfolded, sparing"
        return (f"the sampler {state} a {self.copy_gb:.2f} GB copy of the adapted weights "
                f"({'within' if self.fold else 'over'} {FOLD_SHARE:.0%} of the budget)")


def plan_fold(copy_bytes: int, *, budget_gb: float | None) -> FoldPlan:
    gb = copy_bytes / GB
    return FoldPlan(fold=budget_gb is not None and gb <= FOLD_SHARE * budget_gb, copy_gb=gb, budget_gb=budget_gb)


def activation_bytes(config, *, rows: int, positions: int, dtype: torch.dtype) -> int:
    """What one micro-batch of `rows` x `positions` keeps for backward through a decoder without
    checkpointing, from the model's shapes: per layer and position about ten hidden-size tensors (the
    norms' inputs and outputs, the attention's projections in and out, the residual), five of the MLP's
    intermediate size (gate, up, the activation, their product, the down projection's input) and a row
    of attention probabilities per head. Against SmolLM2-135M with LoRA as measured (16 x 326 positions:
    10.8 GB kept, 11.3 estimated; the demo's 16 x 94: 1.4 GB, 2.5 estimated) it errs high, the safe side."""
    text = getattr(config, "text_config", None) or config
    hidden = text.hidden_size
    inter = getattr(text, "intermediate_size", None) or 4 * hidden
    heads = text.num_attention_heads
    per_position = 10 * hidden + 5 * inter + 2 * heads * positions  # elements, one layer
    return rows * positions * text.num_hidden_layers * per_position * torch.finfo(dtype).bits // 8


def available_gb(device: torch.device) -> float | None:
    """The memory free for a job on `device` now: the GPU's free memory, or the machine's available
    memory (MemAvailable, which counts reclaimable caches); None where neither can be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / GB
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return None


def plan_checkpointing(asked: bool | None, *, activations: int, budget_gb: float | None) -> CheckpointPlan:
    """`asked` when the spec says; otherwise on when a micro-batch's `activations` (bytes) would take more
    than ACTIVATION_SHARE of `budget_gb`: a machine with memory to spare does not pay a second forward."""
    gb = activations / GB
    if asked is not None:
        return CheckpointPlan(checkpointing=asked, activations_gb=gb, budget_gb=budget_gb, asked=True)
    on = budget_gb is not None and gb > ACTIVATION_SHARE * budget_gb
    return CheckpointPlan(checkpointing=on, activations_gb=gb, budget_gb=budget_gb, asked=False)
