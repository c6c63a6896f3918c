"""The job-spec contract: what a client may submit, with every knob documented.

A spec is a pydantic model discriminated on `kind` (`grpo`, `tracin`, `joint`). Every field
has a description and a default, so the OpenAPI page documents the whole surface, and every
cross-field rule is checked here, at submit time, never first discovered by a worker.
This module must stay importable without torch: the API imports it.
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, get_args

from pydantic import BaseModel, Field, TypeAdapter, field_validator, model_validator

from service.core.health import HealthSpec
from service.core.reward_specs import BUILTIN_REWARDS, FunctionReward, RewardSpec
from service.core.spec_base import INT64, _Section, storable  # noqa: F401  (re-exported: the API uses them)

# Names the worker implements. Tests assert these match the worker's registries.
MODEL_PRESETS = ("smollm2-135m-instruct", "tiny-random-llama", "tiny-random-qwen")
RETRIEVER_PRESETS = ("minilm-l6", "tiny-random-bert")
DatasetName = Literal["arith", "file", "jsonl", "persona-facts"]
DATASETS: tuple[DatasetName, ...] = get_args(DatasetName)
LossName = Literal["grpo", "gspo", "cispo"]  # worker/algos/losses.py: one function each
LossAgg = Literal["token_mean", "seq_mean", "dr_grpo"]
HUB_NAMES = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # the presets' public (hub) names
REWARDS = tuple(BUILTIN_REWARDS)
DEFAULT_REWARDS = {"arith": ["numeric_match"], "file": ["exact_match"], "jsonl": ["exact_match"],
                   "persona-facts": ["token_f1"]}
FILE_ID = r"^file-[0-9a-f]{24}$"

_HF_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def reject_unused(section: BaseModel, where: str, fields: tuple[str, ...], unless: str) -> None:
    """A setting this job would ignore is a mistake to report, not a value to drop: refuse any of
    `fields` of `section` that differs from its default (`unless`: when it would take effect)."""
    changed = [f"{where}.{f}" for f in fields
               if getattr(section, f) != type(section).model_fields[f].get_default(call_default_factory=True)]
    if changed:
        raise ValueError(f"{', '.join(changed)} would have no effect: {'it applies' if len(changed) == 1 else 'they apply'} "
                         f"only {unless}; remove {'it' if len(changed) == 1 else 'them'}")


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
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = Field(
        "float32", description="Parameter dtype of the trained policy (float64: for numerical checks on the CPU; "
        "log-probs and losses are computed in at least float32).",
    )
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

    def same_weights_as(self, other: ModelSpec) -> bool:
        """Whether a checkpoint trained as `other` loads into this model: the same base model and the
        same LoRA shape (r, alpha, target modules), or both without LoRA."""

        def shape(m: ModelSpec) -> tuple:
            return m.name, None if m.lora is None else (m.lora.r, m.lora.alpha, tuple(m.lora.target_modules))

        return shape(self) == shape(other)


class DatasetSpec(_Section):
    name: DatasetName = Field(
        "arith",
        description="arith: generated grade-school word problems; persona-facts: generated corpus + "
        "questions (joint jobs); file: files you uploaded (POST /v1/files), named by id in `train_file`, "
        "`val_file` and `corpus_file`; jsonl: rows {prompt, answer} (or {query, answers, gold_doc_id}) from `path`.",
    )
    train_file: str | None = Field(
        None, pattern=FILE_ID, description="file only: the id of one of your files of purpose `train`.")
    val_file: str | None = Field(
        None, pattern=FILE_ID, description="file only: a file of purpose `eval`; default: a seeded held-out "
        "split of `num_val` rows of the train file.")
    corpus_file: str | None = Field(
        None, pattern=FILE_ID, description="file, joint jobs only: a file of purpose `corpus` {id, text}.")
    path: str | None = Field(
        None, description="jsonl only: a file in your folder of the datasets root (GRPO_DATASETS_ROOT/<owner>/), "
        "or 'shared/...' for the admin's shared datasets."
    )
    corpus_path: str | None = Field(
        None, description="jsonl joint jobs only: corpus file {id, text}, found like `path`."
    )
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed of generated tasks and of the train/validation split.")
    num_train: int = Field(2000, ge=1, le=1_000_000, description="Generated tasks: training examples.")
    num_val: int = Field(200, ge=1, le=100_000, description="Generated tasks / jsonl: validation examples.")
    corpus_size: int = Field(
        64, ge=2, le=50_000, description="persona-facts: made-up people; each has a fact document and a "
        "distractor profile in the corpus."
    )
    difficulty: int = Field(
        1, ge=0, le=3,
        description="arith: 0 = a one-digit sum with a one-digit answer (a warm-up that even a random model "
        "answers right about one time in ten, so its groups' rewards differ), 1 = one addition or subtraction "
        "of small numbers, 2 = two operations, 3 = multi-step with multiplication.",
    )
    system_prompt: str | None = Field(
        None, description="System message placed before each prompt when the tokenizer has a chat template; "
        "default: the task's own instruction."
    )
    chat_template: bool = Field(True, description="Apply the tokenizer's chat template when it has one.")
    accuracy: Literal["exact_match", "numeric_match"] | None = Field(
        None, description="The check behind eval/accuracy: exact_match (the normalised answer equals a reference) "
        "or numeric_match (the reply's last number equals a reference number); default: numeric_match for arith, "
        "exact_match otherwise.")

    @property
    def accuracy_check(self) -> str:
        return self.accuracy or ("numeric_match" if self.name == "arith" else "exact_match")

    @field_validator("path", "corpus_path")
    @classmethod
    def _relative(cls, v: str | None) -> str | None:
        if v is None:
            return v
        p = PurePosixPath(v)
        if p.is_absolute() or ".." in p.parts or not v.strip():
            raise ValueError("must be a path relative to the datasets root, without '..'")
        return v

    @model_validator(mode="after")
    def _jsonl_needs_path(self) -> DatasetSpec:
        if self.name == "jsonl" and not self.path:
            raise ValueError("dataset.path is required when dataset.name is 'jsonl'")
        if self.name == "file" and not self.train_file:
            raise ValueError("dataset.train_file is required when dataset.name is 'file': upload one with POST /v1/files")
        if self.name != "jsonl":
            reject_unused(self, "dataset", ("path", "corpus_path"), unless="with dataset.name 'jsonl'")
        if self.name != "file":
            reject_unused(self, "dataset", ("train_file", "val_file", "corpus_file"), unless="with dataset.name 'file'")
        elif self.val_file:
            reject_unused(self, "dataset", ("num_val",), unless="without a val_file (the held-out split's size)")
        if self.name in ("jsonl", "file"):
            reject_unused(self, "dataset", ("num_train",), unless="to generated tasks (a file trains on all its rows)")
        if self.name != "arith":
            reject_unused(self, "dataset", ("difficulty",), unless="with dataset.name 'arith'")
        if self.name != "persona-facts":
            reject_unused(self, "dataset", ("corpus_size",), unless="with dataset.name 'persona-facts'")
        return self


class TrainSpec(_Section):
    """What every kind's loop shares: how long and how fast it trains, and how it evaluates and saves."""

    steps: int = Field(10, ge=1, le=1_000_000, description="Training steps; one batch per step.")
    max_new_tokens: int = Field(64, ge=1, le=32768, description="Generation budget per completion (the greedy "
                                "evaluation's, and GRPO's sampling).")
    stop: list[str] = Field(default_factory=list, description="Stop strings; the completion ends after the first one.")
    micro_batch_size: int = Field(8, ge=1, le=4096, description="Sequences per forward/backward (gradient accumulation).")
    micro_batch_tokens: int | None = Field(
        None, ge=1, le=2**24, description="Also cap a micro-batch at this many token positions (rows x the "
        "longest prompt + the longest completion among them, padding dropped): long completions get smaller "
        "micro-batches, so activation memory follows the budget, not the longest row. A longer row goes alone. "
        "Unset: micro_batch_size rows.")
    learning_rate: float = Field(1e-5, gt=0.0, le=1.0, description="AdamW peak learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="After warm-up: constant or cosine "
                                                       "decay to 0.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="Gradient clipping norm; null disables clipping.")
    eval_every: int = Field(0, ge=0, description="Greedy evaluation on the validation split every N steps (0: only "
                            "at start and end).")
    eval_prompts: int = Field(32, ge=1, le=10_000, description="Validation prompts per evaluation.")
    checkpoint_every: int = Field(0, ge=0, description="Checkpoint every N steps (0: only at the end).")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seeds the data order, sampling and initialisation.")

    SECTION: ClassVar[str] = "train"  # the spec key, in messages

    @property
    def with_reference(self) -> bool:
        """A frozen reference is needed (GRPO's KL)."""
        return False

    @property
    def epochs_per_step(self) -> int:
        """Optimizer steps per training step."""
        return 1

    @property
    def per_step(self) -> tuple[str, int]:
        """(field, value): the units a step splits among processes."""
        raise NotImplementedError

    @model_validator(mode="after")
    def _schedule(self) -> TrainSpec:
        if self.warmup_steps > self.steps:
            raise ValueError(f"{self.SECTION}.warmup_steps must not exceed {self.SECTION}.steps")
        return self


class GRPOSpec(TrainSpec):
    prompts_per_step: int = Field(4, ge=1, le=4096, description="P: prompts sampled per step.")
    num_generations: int = Field(
        4, ge=2, le=512, description="G: completions per prompt; the group that advantages are normalised in."
    )
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="Sampling temperature; log-probs use the same "
                               "scaling.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 disables it.")
    mask_truncated_completions: bool = Field(
        False, description="Exclude completions that hit max_new_tokens without EOS or a stop string from the loss."
    )
    epochs_per_rollout_batch: int = Field(
        1, ge=1, le=64, description="Passes over each rollout batch; clipping only bites from the second on."
    )
    clip_eps_low: float = Field(0.2, ge=0.0, lt=1.0, description="Ratio clip below: 1 - clip_eps_low.")
    clip_eps_high: float = Field(0.2, ge=0.0, le=10.0, description="Ratio clip above: 1 + clip_eps_high (DAPO's "
                                 "clip-higher when larger).")
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of the k3 KL to the frozen reference; 0 skips the "
                           "reference pass.")
    measure_kl: bool = Field(
        False, description="Report `kl` even when kl_coef is 0: one more no-grad forward per micro-batch (and a "
        "frozen copy of the model with full fine-tuning). With kl_coef > 0 it is always reported."
    )
    loss: LossName = Field(
        "grpo", description="grpo: the token-level clipped surrogate; gspo: the sequence's length-normalised ratio, "
        "clipped (GSPO; it wants far smaller clip_eps, e.g. 3e-4 / 4e-4); cispo: REINFORCE with a clipped, "
        "stop-gradient importance weight (CISPO; clipped tokens still train).")
    loss_agg: LossAgg = Field(
        "token_mean", description="token_mean: over all tokens; seq_mean: mean of per-sequence means; dr_grpo: "
        "sum / (B * T)."
    )
    normalize_advantages: bool = Field(True, description="Divide group-centred rewards by the group std (Dr. GRPO: "
                                       "false).")
    advantage_eps: float = Field(1e-4, gt=0.0, description="Added to the group std before dividing.")
    drop_zero_std_groups: bool = Field(
        False, description="Drop groups whose rewards all tie (no signal) and refill with fresh prompts."
    )
    max_refill_rounds: int = Field(2, ge=0, le=16, description="Refill rounds per step when dropping zero-std groups.")
    samples_per_step: int = Field(8, ge=0, le=1024, description="Completions per step recorded with reward and "
                                  "advantage.")

    SECTION: ClassVar[str] = "grpo"

    @property
    def with_reference(self) -> bool:
        """KL to the frozen reference is measured: in the loss (kl_coef > 0) or asked for (measure_kl)."""
        return self.kl_coef > 0 or self.measure_kl

    @property
    def epochs_per_step(self) -> int:
        return self.epochs_per_rollout_batch

    @property
    def per_step(self) -> tuple[str, int]:
        return "grpo.prompts_per_step", self.prompts_per_step

    @model_validator(mode="after")
    def _refills(self) -> GRPOSpec:
        if not self.drop_zero_std_groups:
            reject_unused(self, "grpo", ("max_refill_rounds",), unless="with grpo.drop_zero_std_groups: true")
        return self


class SFTSpec(TrainSpec):
    batch_size: int = Field(8, ge=1, le=4096, description="Examples per step: the train split in a shuffled order "
                            "(reshuffled each pass, seeded by `seed`), in micro-batches of micro_batch_size.")
    learning_rate: float = Field(1e-4, gt=0.0, le=1.0, description="AdamW peak learning rate.")
    val_batches: int = Field(1, ge=0, le=1000, description="Validation batches of batch_size examples whose "
                             "cross-entropy (loss/val) is measured at each evaluation; 0: not measured.")

    SECTION: ClassVar[str] = "sft"

    @property
    def per_step(self) -> tuple[str, int]:
        return "sft.batch_size", self.batch_size


class DevicesSpec(_Section):
    policy: str = Field("cpu", description="Device of the trained policy and the reference, e.g. 'cuda:0'.")
    rollout: str | None = Field(None, description="Device of the frozen rollout copy, e.g. 'cuda:1'; default: policy's.")

    @field_validator("policy", "rollout")
    @classmethod
    def _device(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"cpu|cuda(:\d+)?|mps", v):
            raise ValueError(f"unknown device {v!r}: use 'cpu', 'cuda', 'cuda:N' or 'mps'")
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
    sharding: Literal["none", "fsdp"] = Field(
        "none", description="'fsdp': full fine-tuning with the policy (and reference) sharded across the processes "
        "by FSDP2, for a model that does not fit one device; 'none': every process holds the whole model.")


class SparsityQualitySpec(_Section):
    enabled: bool = Field(False, description="Also run the sparse-update quality analysis (extra forward passes).")
    probe_size: int = Field(4, ge=1, le=256, description="Validation sequences in the fixed probe batch.")
    thresholds: list[float] | None = Field(
        None, description="Magnitude thresholds to test; default: the tracking thresholds."
    )

    @model_validator(mode="after")
    def _only_when_enabled(self) -> SparsityQualitySpec:
        if not self.enabled:
            reject_unused(self, "sparsity.quality", ("probe_size", "thresholds"), unless="with enabled: true")
        return self


class SparsitySpec(_Section):
    measure_interval: int = Field(10, ge=1, description="Measure every N optimizer steps.")
    thresholds: list[float] = Field(
        default_factory=lambda: [0.0, 1e-12, 1e-10, 1e-8, 1e-6, 1e-4],
        description="|delta| <= threshold counts as unchanged.",
    )
    primary_threshold: float = Field(0.0, ge=0.0, description="Threshold of the headline `sparsity/ratio`.")
    rtol: float = Field(1e-3, ge=0.0, description="Relative tolerance: |delta| <= rtol * |w| counts as unchanged.")
    quality: SparsityQualitySpec = Field(default_factory=SparsityQualitySpec)
    kl_prompts: int = Field(8, ge=0, le=1024, description="Held-out task prompts (the first of the validation split) "
                            "on which each report measures KL(pi_0 || pi) against the starting policy: one completion "
                            "each is sampled from pi_0 at the start, and every measurement is one forward over them. "
                            "0: not measured.")

    @field_validator("thresholds")
    @classmethod
    def _nonneg(cls, v: list[float]) -> list[float]:
        if not v or any(t < 0 for t in v):
            raise ValueError("thresholds must be a non-empty list of values >= 0")
        return sorted(v)


# Selections that use no influence: no validation batch, no hooks, the cost of plain GRPO.
BASELINES = ("random", "pass_rate", "all")


class TracInSpec(_Section):
    val_prompts: int = Field(4, ge=1, le=1024, description="Validation prompts per step.")
    val_generations: int = Field(
        4, ge=2, le=256, description="Sampled responses per validation prompt (>= 2: one response has zero advantage)."
    )
    val_regenerate_every: int = Field(1, ge=1, description="Regenerate the validation batch every N steps.")
    selection: Literal["positive", "top_fraction", "top_cosine", "greedy", "random", "pass_rate", "all"] = Field(
        "positive",
        description="By influence: positive (influence > 0), top_fraction (the `fraction` with the largest inner "
        "product), top_cosine (the `fraction` with the largest cosine to the validation gradient), greedy "
        "(GREATS-style, with interactions). Baselines, with no influence computed: random (a random `fraction`), "
        "pass_rate (whole groups nearest 50% correct, up to `fraction`), all (uniform GRPO).",
    )
    fraction: float = Field(0.5, gt=0.0, le=1.0, description="Share of samples kept (every selection but positive "
                            "and all).")
    check_prediction: bool = Field(
        True, description="Every step with an update, re-evaluate the validation objective after it and record the "
        "predicted change (tracin/predicted_delta) beside the actual one (tracin/actual_delta): two forwards of "
        "the validation batch.")

    @model_validator(mode="after")
    def _fraction(self) -> TracInSpec:
        if self.selection in ("positive", "all"):
            reject_unused(self, "tracin", ("fraction",), unless="to selections that keep a fraction")
        if self.selection in BASELINES:
            reject_unused(self, "tracin", ("val_prompts", "val_generations", "val_regenerate_every",
                                           "check_prediction"), unless="to selections by influence")
        return self


class RetrieverSpec(_Section):
    name: str = Field("tiny-random-bert", description="Encoder: minilm-l6, tiny-random-bert, a folder under the "
                      "admin's model roots, or a Hugging Face id in the workers' local cache.")
    k: int = Field(3, ge=1, le=64, description="Documents sampled per query without replacement. Cost: k * G generations per query.")
    temperature: float = Field(1.0, gt=0.0, description="Softmax temperature over retrieval scores.")
    candidates: int = Field(16, ge=1, le=10_000, description="Top-scoring documents forming the sampling pool.")
    refresh_every: int = Field(1, ge=1, description="Re-encode the corpus every N steps.")
    shared_towers: bool = Field(True, description="One encoder for queries and documents.")
    learning_rate: float = Field(1e-5, gt=0.0, description="Retriever learning rate.")
    kl_coef: float = Field(0.01, ge=0.0, description="KL to the frozen reference retriever.")
    clip_eps: float = Field(0.2, ge=0.0, lt=1.0, description="PPO clip range of the retriever loss.")
    score_scale: float = Field(20.0, gt=0.0, description="Scale of the cosine score (score = scale * cos).")
    dtype: Literal["float32", "float64"] = Field("float32", description="Parameter dtype of the encoders (float64: "
                                                 "for numerical checks on the CPU).")
    generator_only: bool = Field(False, description="Freeze the retriever and take its top-k (baseline).")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        return _check_model_name(v, RETRIEVER_PRESETS, "retriever")

    @model_validator(mode="after")
    def _pool(self) -> RetrieverSpec:
        if self.k > self.candidates:
            raise ValueError("retriever.k must not exceed retriever.candidates")
        if self.k < 2 and not self.generator_only:
            raise ValueError("retriever.k must be >= 2 to train the retriever: document advantages are "
                             "normalised within the k documents, so one document always gets zero")
        if self.generator_only:  # the top k, never trained
            reject_unused(self, "retriever", ("temperature", "learning_rate", "kl_coef", "clip_eps"),
                          unless="to a trained retriever (generator_only: false)")
        return self


class _JobBase(_Section):
    if TYPE_CHECKING:  # each kind's own Literal field, the union's tag
        kind: str
    name: str | None = Field(None, max_length=200, description="Free-text label shown in lists and the dashboard.")
    model: ModelSpec = Field(default_factory=ModelSpec)
    dataset: DatasetSpec = Field(default_factory=DatasetSpec)
    rewards: list[RewardSpec] | None = Field(
        None, min_length=1, description="Reward functions, summed with weights; default depends on the dataset."
    )
    devices: DevicesSpec = Field(default_factory=DevicesSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    sparsity: SparsitySpec | None = Field(None, description="Parameter-update sparsity reports; omit to skip.")
    health: HealthSpec = Field(default_factory=HealthSpec, description="Thresholds of the per-step health guards "
                               "(flagged as `health` events, summed up on the job) and which of them stop the job.")

    @property
    def train(self) -> TrainSpec:
        """The kind's training section (grpo, sft): what every loop's skeleton reads."""
        raise NotImplementedError

    def reward_specs(self) -> list[RewardSpec]:
        if self.rewards:
            return self.rewards
        return [FunctionReward(name=n) for n in DEFAULT_REWARDS[self.dataset.name]]

    @model_validator(mode="after")
    def _common(self) -> _JobBase:
        if self.rewards is not None and all(r.weight == 0 for r in self.rewards):
            raise ValueError("rewards: at least one reward needs a non-zero weight")
        keys = [r.key for r in self.reward_specs()]
        if dup := sorted({k for k in keys if keys.count(k) > 1}):
            raise ValueError(f"rewards: two entries named {', '.join(dup)}: give each a different `tag` "
                             "(it names the entry's metric reward/<tag>/mean)")
        if self.resources.sharding == "fsdp" and self.resources.processes < 2:
            raise ValueError("resources.sharding 'fsdp' needs resources.processes >= 2 to shard across")
        if (n := self.resources.processes) > 1:
            field, units = self.train.per_step
            if units % n:
                raise ValueError(f"{field} ({units}) must be divisible by resources.processes ({n}): each process "
                                 "takes an equal share of a step")
            if self.resources.sharding == "fsdp":
                if self.kind != "grpo":
                    raise ValueError(f"resources.sharding 'fsdp' is supported for kind 'grpo', not {self.kind!r}: "
                                     "its processes each hold the whole model (sharding 'none')")
                if self.model.lora is not None:
                    raise ValueError("resources.sharding 'fsdp' shards a fully fine-tuned model: remove model.lora "
                                     "(a LoRA job's trained weights are small; use sharding 'none')")
                if getattr(self.train, "drop_zero_std_groups", False):
                    raise ValueError("resources.sharding 'fsdp' runs every process's forwards in lockstep, so each "
                                     "takes the same number of prompts: grpo.drop_zero_std_groups (refills of "
                                     "uneven size) is not supported with it")
                if self.sparsity is not None and self.sparsity.quality.enabled:
                    raise ValueError("sparsity.quality is not supported with resources.sharding 'fsdp': its probe "
                                     "rewrites the weights, which are sharded")
            if self.devices.rollout is not None or ":" in self.devices.policy:
                raise ValueError("devices: with resources.processes > 1 each process takes its own device (a GPU "
                                 "each where there are enough, else the CPU): leave devices.policy 'cpu' or "
                                 "'cuda' and devices.rollout unset")
        if self.rollout.engine == "vllm":
            if self.resources.sharding == "fsdp":
                raise ValueError("rollout.engine 'vllm' is not supported with resources.sharding 'fsdp': the "
                                 "server loads whole weights; use sharding 'none'")
            if self.model.dtype == "float64":
                raise ValueError("rollout.engine 'vllm' serves float32, bfloat16 or float16: set model.dtype to one "
                                 "of them")
            if self.devices.rollout is not None:
                raise ValueError("devices.rollout places the hf engine's copy; with rollout.engine 'vllm' the "
                                 "server takes its own device: remove devices.rollout")
        if self.rollout.max_staleness and self.kind not in ("grpo", "tracin"):
            raise ValueError(f"rollout.max_staleness 1 is supported for kinds 'grpo' and 'tracin', not {self.kind!r}: "
                             "set it to 0")
        return self


def _no_corpus(d: DatasetSpec) -> None:
    """Kinds without a retriever: no retrieval task, no corpus."""
    if d.name == "persona-facts":
        raise ValueError("dataset.name 'persona-facts' is a retrieval task: use kind 'joint'")
    reject_unused(d, "dataset", ("corpus_path", "corpus_file"), unless="to kind 'joint' (a corpus to retrieve from)")


class _GRPOKinds(_JobBase):
    """The kinds that train with GRPO."""

    grpo: GRPOSpec = Field(default_factory=GRPOSpec)

    @property
    def train(self) -> GRPOSpec:
        return self.grpo


class GRPOJob(_GRPOKinds):
    """GRPO / GRPO-Clip: group sampling, group-normalised advantages, clipped surrogate, k3 KL."""

    kind: Literal["grpo"] = "grpo"

    @model_validator(mode="after")
    def _dataset(self) -> GRPOJob:
        _no_corpus(self.dataset)
        return self


class TracInJob(_GRPOKinds):
    """GRPO that trains only on samples whose TracIn influence on a validation batch helps."""

    kind: Literal["tracin"] = "tracin"
    tracin: TracInSpec = Field(default_factory=TracInSpec)

    @model_validator(mode="after")
    def _needs_lora(self) -> TracInJob:
        if self.model.lora is None:
            raise ValueError("model.lora is required for kind 'tracin': influence is computed over LoRA weights")
        _no_corpus(self.dataset)
        return self


class JointJob(_GRPOKinds):
    """Joint retriever + generator GRPO: k documents per query, G answers per document."""

    kind: Literal["joint"] = "joint"
    retriever: RetrieverSpec = Field(default_factory=RetrieverSpec)

    @model_validator(mode="after")
    def _needs_corpus(self) -> JointJob:
        d = self.dataset
        if d.name == "arith":
            raise ValueError("dataset.name 'arith' has no corpus: kind 'joint' needs 'persona-facts' or 'jsonl'")
        if d.name == "jsonl" and not d.corpus_path:
            raise ValueError("dataset.corpus_path is required for kind 'joint' with a jsonl dataset")
        if d.name == "file" and not d.corpus_file:
            raise ValueError("dataset.corpus_file is required for kind 'joint' with dataset.name 'file'")
        return self


class SFTJob(_JobBase):
    """Supervised fine-tuning: cross-entropy on the answer tokens of {prompt, answer} rows."""

    kind: Literal["sft"] = "sft"
    sft: SFTSpec = Field(default_factory=SFTSpec)

    @property
    def train(self) -> SFTSpec:
        return self.sft

    @model_validator(mode="after")
    def _dataset(self) -> SFTJob:
        _no_corpus(self.dataset)
        return self


class SessionSpec(_Section):
    """What the tinker client asked for when it created the training run (`create_model`)."""

    tinker_session: str = Field(max_length=40, description="The tinker SDK session that created this run.")
    model_id: str = Field(pattern=r"^[0-9a-f]{32}$", description="The run's id for the SDK: its job's uid.")
    model_seq_id: int = Field(0, ge=0, le=2**31 - 1, description="The client's number for this run in its session.")
    seed: int | None = Field(None, ge=0, le=2**32 - 1, description="Seed of the LoRA initialisation (random when null).")
    idle_timeout_s: float = Field(120.0, gt=0, le=86400, description="A worker holding the run gives it back after "
                                  "this long with no operation; the next operation brings it back from its last state.")
    sampling_only: bool = Field(False, description="A run create_sampling_session made for a base model: it samples "
                                "the model's own weights and trains nothing.")


class SessionJob(_Section):
    """A training run driven operation by operation from the tinker SDK (`forward_backward`,
    `optim_step`, ...): created by `/api/v1/create_model`, never submitted as a spec."""

    kind: Literal["session"] = "session"
    name: str | None = Field(None, max_length=200, description="Free-text label shown in lists and the dashboard.")
    model: ModelSpec = Field(default_factory=ModelSpec)
    devices: DevicesSpec = Field(default_factory=DevicesSpec)
    session: SessionSpec


SubmittedSpec = Annotated[GRPOJob | TracInJob | JointJob | SFTJob, Field(discriminator="kind")]  # what a client submits
JobSpec = Annotated[GRPOJob | TracInJob | JointJob | SFTJob | SessionJob, Field(discriminator="kind")]  # what is stored
JOB_MODELS: tuple[type[_JobBase], ...] = get_args(get_args(SubmittedSpec)[0])
KINDS: tuple[str, ...] = tuple(get_args(m.model_fields["kind"].annotation)[0] for m in get_args(get_args(JobSpec)[0]))
_SUBMITTED_SPEC: TypeAdapter = TypeAdapter(SubmittedSpec)
_JOB_SPEC: TypeAdapter = TypeAdapter(JobSpec)


def parse_spec(data: object) -> GRPOJob | TracInJob | JointJob | SFTJob:
    """A submitted job spec from its JSON form (a request body, a YAML file); ValidationError if wrong."""
    return _SUBMITTED_SPEC.validate_python(data)


def parse_stored_spec(data: object) -> GRPOJob | TracInJob | JointJob | SFTJob | SessionJob:
    """A stored job's spec, session runs included; ValidationError if this version cannot read it."""
    return _JOB_SPEC.validate_python(data)


class Status(StrEnum):
    """A job's status: queued -> running -> succeeded | failed | cancelled (service/store/leases.py); a session
    run also goes running -> idle -> queued."""

    queued = "queued"
    running = "running"
    idle = "idle"  # a session run no worker holds until its next operation arrives
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


STATUSES: tuple[str, ...] = tuple(s.value for s in Status)
TERMINAL: tuple[str, ...] = (Status.succeeded.value, Status.failed.value, Status.cancelled.value)
