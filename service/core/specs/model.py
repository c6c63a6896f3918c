"""What a job trains: the base model (a bundled preset, a folder under the admin's model roots or a
cached Hugging Face id), its LoRA adapter, and the checkpoint it may start from."""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Literal

from pydantic import Field, field_validator, model_validator

from service.core.spec_base import _Section, reject_unused

# Names the worker implements. Tests assert these match the worker's registries.
MODEL_PRESETS = ("smollm2-135m-instruct", "tiny-random-llama", "tiny-random-qwen")
RETRIEVER_PRESETS = ("minilm-l6", "tiny-random-bert")
HUB_NAMES = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # the presets' public (hub) names

_HF_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def unavailable_model(what: str, name: str, presets: tuple[str, ...]) -> str:
    """The one message for a model that is missing or not allowed (so neither can be told apart)."""
    return (f"{what} {name!r} is not available: use a bundled preset ({', '.join(presets)}), a folder "
            "under the admin's model roots (GRPO_MODEL_ROOTS), or a Hugging Face id in the local cache")


def _check_model_name(name: str, presets: tuple[str, ...], what: str) -> str:
    """Presets, or a relative name: whether it exists is checked against the admin's settings at
    submit time (service.sources); a server path is never a name."""
    p = PurePosixPath(name)
    if name in presets or (name.strip() and not p.is_absolute() and ".." not in p.parts
                           and not name.startswith(("~", "./")) and "\\" not in name):
        return name
    raise ValueError(unavailable_model(what, name, presets))


class LoraSpec(_Section):
    r: int = Field(8, ge=1, le=1024, description="LoRA rank.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names to adapt (e.g. ['q_proj', 'v_proj']) or 'all-linear'."
    )


class InitFrom(_Section):
    job: int = Field(ge=1, le=2**31 - 1, description="The id of one of your earlier jobs.")
    step: int | None = Field(None, ge=0, le=2**31 - 1, description="The step of one of its checkpoints "
                             "(GET /v1/jobs/{job}/checkpoints); default: its latest.")


class ModelSpec(_Section):
    name: str = Field(
        "tiny-random-llama",
        description="Bundled preset (smollm2-135m-instruct, tiny-random-llama, tiny-random-qwen), a folder "
        "under the admin's model roots (GRPO_MODEL_ROOTS), e.g. 'team/llama-1b', or a Hugging Face id "
        "already in the workers' local cache.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = Field(
        "auto", description="Parameter dtype of the trained policy (float64: for numerical checks on the CPU; "
        "log-probs and losses are computed in at least float32). With bfloat16/float16, a LoRA adapter stays "
        "float32 and full fine-tuning steps float32 master weights, rounded into the model after each step. "
        "`auto`: bfloat16 where the job's device multiplies it natively (at least 1.5x float32's matmul rate, "
        "measured when the job starts and cached per machine: GPUs, CPUs with AMX or AVX512-BF16), else float32; the "
        "`memory_plan` event says which and why, and the fingerprint's `dtype` records it.",
    )
    activations: Literal["auto", "float32", "weights"] = Field(
        "auto", description="The dtype of what flows between a bfloat16/float16 model's matmuls (the residual "
        "stream, norms, attention, the KV cache and the LoRA adapter's sum with its base layer): `float32`, each "
        "frozen linear layer multiplying its input in the weights' dtype and handing float32 on, so an adapter's "
        "early updates are not rounded away (on SmolLM2 with adapter factors of 1e-3, about ten steps in, the "
        "log-probs' change follows float32's with a cosine of 0.29 against 0.006 in bfloat16 activations; "
        "bench/precision.py); `weights`, the weights' dtype throughout, as on a GPU, whose attention kernels want "
        "it. `auto`: float32 on a CPU, the weights' dtype on a GPU.")
    chat_template: Literal["tokenizer", "chatml-tools"] = Field(
        "tokenizer", description="The chat template prompts and episodes are rendered with: the tokenizer's own, "
        "or `chatml-tools`, ChatML (as SmolLM2 writes it) with tools and tool messages in the Hermes/Qwen2.5 "
        "format, for a ChatML model whose own template cannot show tools (SmolLM2's). An environment with "
        "`tools` needs a template that renders them.")
    fp32_head: bool = Field(
        False, description="Run the LM head's matmul in float32 over the bfloat16/float16 weights, in sampling and "
        "training alike (TRL's cast_lm_head_to_fp32; tied heads included): on SmolLM2 in bfloat16 it cuts the "
        "sampler-to-trainer log-prob gap by a quarter (0.034 to 0.025 nats a token). Costs a float32 copy of the "
        "head (vocabulary x hidden x 4 bytes) and the head's matmul at float32 speed. The hf engine only: a vllm "
        "engine's logits stay in its dtype, and its mismatch correction covers the gap.")
    lora: LoraSpec | None = Field(None, description="Train a LoRA adapter; omit for full fine-tuning.")
    gradient_checkpointing: bool | None = Field(
        None, description="Recompute each decoder layer's activations in backward instead of keeping them: a "
        "micro-batch keeps one layer's activations and every layer's input, for one more forward of training "
        "compute. Unset: the worker decides when the job starts, on when a micro-batch's activations (estimated "
        "from the model's shapes, micro_batch_size rows of the longest prompt plus max_new_tokens, at most "
        "micro_batch_tokens) would take more than half the memory free for it (GRPO_MEMORY_BUDGET_GB, or what "
        "the device has available); a `memory_plan` event says which and why.")
    init_from: InitFrom | None = Field(
        None, description="Start from the weights of one of your own checkpoints (train on from it): it must be of "
        "the same model.name, and a LoRA adapter of the same r, alpha and target_modules (or full weights for full "
        "fine-tuning). Optimizer state starts fresh; with LoRA the KL reference stays the base model.",
    )

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        return _check_model_name(v, MODEL_PRESETS, "model")

    @model_validator(mode="after")
    def _head_in_float32(self) -> ModelSpec:
        if self.dtype in ("float32", "float64"):
            reject_unused(self, "model", ("fp32_head", "activations"), unless="to a bfloat16 or float16 model")
        return self

    def same_weights_as(self, other: ModelSpec) -> bool:
        """Whether a checkpoint trained as `other` loads into this model: the same base model and the
        same LoRA shape (r, alpha, target modules), or both without LoRA."""

        def shape(m: ModelSpec) -> tuple[object, ...]:
            return m.name, None if m.lora is None else (m.lora.r, m.lora.alpha, tuple(m.lora.target_modules))

        return shape(self) == shape(other)
