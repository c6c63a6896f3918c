"""What a job trains on: a bundled task, an uploaded file, a file of the owner's datasets folder, and
the rewards each dataset defaults to."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Literal, get_args

from pydantic import Field, field_validator, model_validator

from service.core.reward_specs import BUILTIN_REWARDS
from service.core.spec_base import _Section, reject_unused

DatasetName = Literal["arith", "file", "jsonl", "persona-facts", "env-demos"]
DATASETS: tuple[DatasetName, ...] = get_args(DatasetName)
REWARDS = tuple(BUILTIN_REWARDS)
DEFAULT_REWARDS = {"arith": ["numeric_match"], "file": ["exact_match"], "jsonl": ["exact_match"],
                   "persona-facts": ["token_f1"],
                   "env-demos": ["exact_match"]}  # never scored: the job's environment evaluates it
FILE_ID = r"^file-[0-9a-f]{24}$"


class DatasetSpec(_Section):
    name: DatasetName = Field(
        "arith",
        description="arith: generated grade-school word problems; persona-facts: generated corpus + "
        "questions (joint jobs); file: files you uploaded (POST /v1/files), named by id in `train_file`, "
        "`val_file` and `corpus_file`; jsonl: rows {prompt, answer} (or {query, answers, gold_doc_id}) from `path`; "
        "env-demos (sft jobs with an `environment`): `num_train` + `num_val` correct episodes of the job's bundled "
        "tool environment, played by a scripted solver that calls its tools, as the model would see them.",
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
    val_path: str | None = Field(
        None, description="jsonl only: validation rows {prompt, answer}, found like `path`; default: a seeded "
        "held-out split of `num_val` rows of `path`."
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

    @field_validator("path", "val_path", "corpus_path")
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
            reject_unused(self, "dataset", ("path", "val_path", "corpus_path"), unless="with dataset.name 'jsonl'")
        if self.name != "file":
            reject_unused(self, "dataset", ("train_file", "val_file", "corpus_file"), unless="with dataset.name 'file'")
        elif self.val_file:
            reject_unused(self, "dataset", ("num_val",), unless="without a val_file (the held-out split's size)")
        if self.val_path:
            reject_unused(self, "dataset", ("num_val",), unless="without a val_path (the held-out split's size)")
        if self.name in ("jsonl", "file"):
            reject_unused(self, "dataset", ("num_train",), unless="to generated tasks (a file trains on all its rows)")
        if self.name != "arith":
            reject_unused(self, "dataset", ("difficulty",), unless="with dataset.name 'arith'")
        if self.name != "persona-facts":
            reject_unused(self, "dataset", ("corpus_size",), unless="with dataset.name 'persona-facts'")
        return self
