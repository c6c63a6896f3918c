"""The job-spec contract: what a client may submit, with every knob documented.

A spec is a pydantic model discriminated on `kind` (`grpo`, `tracin`, `joint`, `sft`; `session` for a
tinker run, which the API creates). Every field has a description and a default, so the OpenAPI page
documents the whole surface, and every cross-field rule is checked here, at submit time, never first
discovered by a worker. The package must stay importable without torch: the API imports it.

Its modules, by topic: `model` (the base model, LoRA, a starting checkpoint), `data` (datasets and their
default rewards), `training` (the loop's schedule, GRPO's and SFT's knobs), `runtime` (devices, the
rollout engine, processes), `extras` (sparsity reports, TracIn, the retriever), `environment` (a multi-turn
environment's server and episodes) and `jobs` (a whole spec
per kind and the rules across its sections). Import from here.
"""

from service.core.loss_names import LossAgg, LossName
from service.core.specs.data import DATASETS, DEFAULT_REWARDS, FILE_ID, REWARDS, DatasetName, DatasetSpec
from service.core.specs.environment import BUNDLED_ENVIRONMENTS, EnvironmentSpec
from service.core.specs.extras import BASELINES, PAIRWISE, RetrieverSpec, SparsityQualitySpec, SparsitySpec, TracInSpec
from service.core.specs.jobs import (
    JOB_MODELS,
    KINDS,
    STATUSES,
    TERMINAL,
    GRPOJob,
    JobSpec,
    JointJob,
    SessionJob,
    SessionSpec,
    SFTJob,
    Status,
    SubmittedSpec,
    TracInJob,
    parse_spec,
    parse_stored_spec,
)
from service.core.specs.model import (
    _HF_ID,
    HUB_NAMES,
    MODEL_PRESETS,
    RETRIEVER_PRESETS,
    InitFrom,
    LoraSpec,
    ModelSpec,
    unavailable_model,
)
from service.core.specs.runtime import DevicesSpec, ResourcesSpec, RolloutSpec
from service.core.specs.training import GRPOSpec, SFTSpec, TrainSpec

__all__ = [
    "BASELINES", "PAIRWISE", "BUNDLED_ENVIRONMENTS", "DATASETS", "DEFAULT_REWARDS", "FILE_ID", "HUB_NAMES", "JOB_MODELS", "KINDS", "MODEL_PRESETS",
    "RETRIEVER_PRESETS", "REWARDS", "STATUSES", "TERMINAL", "_HF_ID", "DatasetName", "DatasetSpec", "DevicesSpec", "EnvironmentSpec",
    "GRPOJob", "GRPOSpec", "InitFrom", "JobSpec", "JointJob", "LoraSpec", "LossAgg", "LossName", "ModelSpec",
    "ResourcesSpec", "RetrieverSpec", "RolloutSpec", "SFTJob", "SFTSpec", "SessionJob", "SessionSpec",
    "SparsityQualitySpec", "SparsitySpec", "Status", "SubmittedSpec", "TracInJob", "TracInSpec", "TrainSpec",
    "parse_spec", "parse_stored_spec", "unavailable_model",
]
