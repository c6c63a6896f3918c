"""Where a job runs: the devices of the policy and its rollout copy, the rollout engine, and how many
processes a job takes."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from service.core.spec_base import _Section, reject_unused


class DevicesSpec(_Section):
    policy: str = Field(
        "auto", description="Device of the trained policy and the reference: 'auto', the worker's first GPU where it "
        "has one and its CPU otherwise (with several processes, a GPU per process where there are enough); 'cuda', "
        "a GPU per process, only on a worker that has them (the job waits for one); or one named, e.g. 'cuda:1', "
        "only on a worker with that many.")
    rollout: str | None = Field(None, description="Device of the frozen rollout copy, e.g. 'cuda:1'; default: policy's.")

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        return v if v == "auto" else _device(v, "'auto', ")

    @field_validator("rollout")
    @classmethod
    def _rollout(cls, v: str | None) -> str | None:
        return None if v is None else _device(v, "")


def gpus_needed(devices: DevicesSpec, processes: int) -> int:
    """The GPUs a job needs on one worker, from the devices it names: 0 for 'auto', 'cpu' and 'mps' (any
    worker takes it, and trains on its GPU where it has one); a GPU per process for 'cuda'; N+1 for a named
    'cuda:N'. Its queue follows (service/core/queue.py): a worker without them never takes it."""
    named = [d for d in (devices.policy, devices.rollout) if d is not None and d.startswith("cuda")]
    if not named:
        return 0
    return max(processes if d == "cuda" else gpus_named(d) for d in named)


def gpus_named(device: str) -> int:
    """The GPUs a worker must have for one process on `device`: N+1 for 'cuda:N' (1 for 'cuda'), 0 off CUDA."""
    return int(device.partition(":")[2] or 0) + 1 if device.startswith("cuda") else 0


def _device(v: str, auto: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?|mps", v):
        raise ValueError(f"unknown device {v!r}: use {auto}'cpu', 'cuda', 'cuda:N' or 'mps'")
    return v


class RolloutSpec(_Section):
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="What samples the rollouts: 'hf', Hugging Face generate on a frozen copy of the policy in "
        "the training process; 'vllm', a vLLM server started for the job (a worker with GRPO_VLLM_PYTHON), weights "
        "synced every step, token ids in and out.")
    correction: Literal["none", "truncated", "masked"] | None = Field(
        None, description="Importance-sampling correction of the engine's samples by pi_trainer / q_engine: "
        "'truncated' caps the weight at correction_cap, 'masked' drops tokens (or sequences) whose ratio leaves "
        "[1/cap, cap], 'none' only measures. Default: 'truncated' with vllm; only for vllm.")
    correction_level: Literal["token", "sequence"] = Field(
        "token", description="The ratio per token, or per sequence (the product over its tokens, one weight for "
        "all of them).")
    correction_cap: float = Field(2.0, gt=1.0, le=1e6, description="C: the truncation cap, and the masking band "
                                  "[1/C, C].")
    gpu_memory_utilization: float | None = Field(
        None, gt=0.0, le=0.95, description="The share of its GPU's memory the vllm server may take (weights, KV "
        "cache, activations). Default: 0.3 where it shares the trainer's GPU, 0.85 on a GPU of its own (the worker "
        "gives it one no process trains on, where it has one); unused on a CPU worker.")
    max_staleness: Literal[0, 1] = Field(
        0, description="Policy updates a training sample may lag behind: 0, sampled by the weights it trains; 1, "
        "step k+1's first rollouts are sampled by the engine while step k trains (refills stay on-policy). With "
        "vllm, kinds grpo and tracin; the correction weighs each token by the trainer's over the sampler's "
        "log-prob.")

    @property
    def correction_mode(self) -> Literal["none", "truncated", "masked"]:
        """The correction in effect: the one set, or 'truncated' for vllm and 'none' for hf."""
        if self.correction is not None:
            return self.correction
        return "truncated" if self.engine == "vllm" else "none"

    @model_validator(mode="after")
    def _hf_has_no_mismatch(self) -> RolloutSpec:
        if self.engine == "hf":
            reject_unused(self, "rollout", ("gpu_memory_utilization",), unless="with rollout.engine 'vllm' (the hf "
                          "engine's copy is on devices.rollout, in the trainer's process)")
            reject_unused(self, "rollout", ("correction", "correction_level", "correction_cap"),
                          unless="with rollout.engine 'vllm' (the hf engine's log-probs are the trainer's own)")
            if self.max_staleness:
                raise ValueError("rollout.max_staleness 1 needs rollout.engine 'vllm': the hf engine samples in the "
                                 "training process, between its updates")
        return self


class ResourcesSpec(_Section):
    processes: int = Field(1, ge=1, le=64, description="Processes (ranks) the job runs as on one worker, data "
                           "parallel over torch.distributed: each samples, scores and trains on its share of "
                           "the step's prompts, and the gradients are summed. One GPU each where the worker "
                           "has that many, a share of its CPU cores otherwise.")
    nodes: int = Field(1, ge=1, le=64, description="Workers (machines) the job spans, each running "
                       "`processes` ranks: the job starts when that many workers have each taken a node of it, "
                       "and its ranks are numbered node by node. Needs workers that each say they are a "
                       "different node (GRPO_NODE_NAME) and reach each other (GRPO_NODE_ADDRESS).")
    sharding: Literal["none", "fsdp"] = Field(
        "none", description="'fsdp': full fine-tuning with the policy (and reference) sharded across the processes "
        "by FSDP2, for a model that does not fit one device; 'none': every process holds the whole model.")

    @property
    def world(self) -> int:
        """The job's ranks on all its nodes."""
        return self.nodes * self.processes
