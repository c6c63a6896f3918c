"""The `rewards` entries of a job spec: built-in and plugin functions, and the model-based and remote kinds.

An entry's `name` picks its kind: `reward_model`, `judge`, `similarity` and `http` take their own
parameters; any other name is a reward function, built in or installed on the workers as a plugin
under the entry-point group `grpo_jobs.rewards`. Every entry has a `weight`; `tag` names its metric
(`reward/<tag>/mean`, default: its name). Never imports torch: the API validates with it.
"""

from __future__ import annotations

import string
from functools import lru_cache
from importlib.metadata import entry_points
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from service.core.grader_urls import parse_url
from service.core.spec_base import _Section

PLUGIN_GROUP = "grpo_jobs.rewards"

# What the workers implement (tests assert the worker's registry matches), with what each does.
BUILTIN_REWARDS: dict[str, str] = {
    "numeric_match": "1.0 when the last number of the (tagged) answer equals a reference number.",
    "exact_match": "1.0 when the normalised answer equals a normalised reference.",
    "token_f1": "Best SQuAD token F1 against the references.",
    "rouge_l": "Best ROUGE-L F-measure (rouge-score) against the references.",
    "bleu": "Sentence BLEU (sacrebleu, exponential smoothing) in [0, 1].",
    "r1_math": "R1-zero math reward: 1.0 only with the <think>/<answer> format and a correct answer.",
    "r1_format": "1.0 for the R1-zero format `<think>...</think> <answer>...</answer>`, else 0.",
    "answer_tag_match": "1.0 when an <answer> tag is present and its number matches.",
}
PLACEHOLDERS = ("prompt", "completion", "answer")
JUDGE_RUBRIC = ("Question: {prompt}\nReference answer: {answer}\nResponse: {completion}\n\n"
                "Does the response give the reference answer? Answer Yes or No.")


@lru_cache(maxsize=1)
def plugins() -> dict[str, str]:
    """Reward functions installed under the entry-point group: name -> 'module:function (dist version)'.
    Read from package metadata only: nothing is imported."""
    out = {}
    for ep in entry_points(group=PLUGIN_GROUP):
        dist = f" ({ep.dist.name} {ep.dist.version})" if ep.dist is not None else ""
        out[ep.name] = f"{ep.value}{dist}"
    return out


def function_names() -> tuple[str, ...]:
    return (*BUILTIN_REWARDS, *(n for n in plugins() if n not in BUILTIN_REWARDS))


def _template(v: str) -> str:
    """A template may use {prompt}, {completion} and {answer}, and must use {completion}."""
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(v) if f is not None}
    except ValueError as exc:
        raise ValueError(f"not a valid template ({exc}); write literal braces as {{{{ and }}}}") from None
    unknown = fields - set(PLACEHOLDERS)
    if unknown:
        raise ValueError(f"unknown placeholder(s) {', '.join(sorted('{' + f + '}' for f in unknown))}: "
                         f"use {', '.join('{' + p + '}' for p in PLACEHOLDERS)}")
    if "completion" not in fields:
        raise ValueError("the template must contain {completion}: it is what is scored")
    return v


class _Entry(_Section):
    weight: float = Field(1.0, ge=-1e6, le=1e6, description="Weight in the summed reward.")
    tag: str | None = Field(None, pattern=r"^[a-z][a-z0-9_]{0,39}$",
                            description="Names this entry's metric, reward/<tag>/mean (default: its name); "
                            "two entries with one name need different tags.")

    @property
    def key(self) -> str:
        return self.tag or self.name  # type: ignore[attr-defined]


class FunctionReward(_Entry):
    """A reward function of (completion, answers), built in or an installed plugin."""

    name: str = Field(description="A built-in function (GET /v1/rewards lists them) or an installed plugin.")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in function_names():
            raise ValueError(f"unknown reward {v!r}: use one of {', '.join(function_names())}, or the kinds "
                             f"{', '.join(MODEL_KINDS)}")
        return v


class RewardModelReward(_Entry):
    """A sequence classifier (AutoModelForSequenceClassification) scores prompt and completion."""

    name: Literal["reward_model"] = Field(description="The kind of this entry.")
    model: str = Field(description="A folder under the admin's model roots, or a Hugging Face id in the workers' "
                       "local cache.")
    template: str = Field("{prompt}\n{completion}", description="The classifier's input; placeholders {prompt}, "
                          "{completion}, {answer}. Ignored with chat_template.")
    chat_template: bool = Field(False, description="Format prompt and completion as a user and an assistant turn "
                                "with the classifier tokenizer's chat template instead of `template`.")
    target: int | str = Field(0, description="The output that is the score: an index, or a label of the model's "
                              "id2label.")
    output: Literal["logit", "probability"] = Field(
        "logit", description="logit: the raw output; probability: its softmax over the labels (sigmoid for a "
        "one-output model).")
    max_length: int = Field(512, ge=8, le=32768, description="Inputs are truncated to this many tokens.")
    batch_size: int = Field(16, ge=1, le=1024, description="Inputs per forward pass.")

    @field_validator("template")
    @classmethod
    def _placeholders(cls, v: str) -> str:
        return _template(v)


class JudgeReward(_Entry):
    """A generative model asked a rubric; one forward pass, no sampling."""

    name: Literal["judge"] = Field(description="The kind of this entry.")
    model: str = Field("smollm2-135m-instruct", description="A causal LM: a bundled preset, a folder under the "
                       "admin's model roots, or a Hugging Face id in the workers' local cache.")
    rubric: str = Field(JUDGE_RUBRIC, description="The question put to the judge (a user turn through its chat "
                        "template); placeholders {prompt}, {completion}, {answer}.")
    mode: Literal["yes_probability", "number"] = Field(
        "yes_probability", description="yes_probability: P(yes) / (P(yes) + P(no)) of the first answer token; "
        "number: the number the judge writes (greedy), mapped from number_range to [0, 1].")
    yes: str = Field("Yes", min_length=1, max_length=20, description="The token that means yes.")
    no: str = Field("No", min_length=1, max_length=20, description="The token that means no.")
    number_range: tuple[float, float] = Field((0.0, 10.0), description="number mode: the rubric's scale.")
    batch_size: int = Field(8, ge=1, le=1024, description="Prompts per forward pass.")

    @field_validator("rubric")
    @classmethod
    def _placeholders(cls, v: str) -> str:
        return _template(v)

    @model_validator(mode="after")
    def _range(self) -> JudgeReward:
        lo, hi = self.number_range
        if not lo < hi:
            raise ValueError("number_range must be (low, high) with low < high")
        return self


class SimilarityReward(_Entry):
    """Cosine similarity of the completion to the closest reference answer under a sentence encoder."""

    name: Literal["similarity"] = Field(description="The kind of this entry.")
    model: str = Field("minilm-l6", description="A sentence encoder (mean pooling): minilm-l6, a folder under the "
                       "admin's model roots, or a Hugging Face id in the workers' local cache.")
    batch_size: int = Field(32, ge=1, le=4096, description="Texts per forward pass.")


class HttpReward(_Entry):
    """A grader the user runs: POST {job_id, step, items: [{prompt, completion, answer, answers}]} ->
    {scores: [float | null]} (null: cannot score; that completion is excluded)."""

    name: Literal["http"] = Field(description="The kind of this entry.")
    url: str = Field(max_length=2000, description="Must lie under one of the admin's allowed URLs "
                     "(GRPO_REWARD_URLS): the same scheme, host and port, and a path at or below the entry's; no "
                     "userinfo, fragment or double percent-encoding.")
    timeout_s: float = Field(30.0, gt=0, le=600, description="Per request.")
    max_retries: int = Field(2, ge=0, le=10, description="Retries of a request that failed to connect, timed out "
                             "or got a 5xx answer, with exponential backoff.")
    batch_size: int = Field(64, ge=1, le=4096, description="Items per request.")
    concurrency: int = Field(4, ge=1, le=64, description="Requests in flight at once.")
    max_failed_steps: int = Field(3, ge=1, le=1000, description="The job fails after this many steps in a row in "
                                  "which the grader could not score a batch (each such batch is excluded, with a "
                                  "warning event).")

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        parse_url(v)  # UrlRefused is a ValueError: a 422 saying what is wrong with the URL
        return v


MODEL_KINDS = ("reward_model", "judge", "similarity", "http")
_KIND_OF = {"reward_model": "reward_model", "judge": "judge", "similarity": "similarity", "http": "http"}


def _kind(v: Any) -> str:
    name = v.get("name") if isinstance(v, dict) else getattr(v, "name", None)
    return _KIND_OF.get(name, "function") if isinstance(name, str) else "function"


RewardSpec = Annotated[
    Union[  # noqa: UP007 (five tagged models read better as a list)
          Annotated[FunctionReward, Tag("function")], Annotated[RewardModelReward, Tag("reward_model")],
          Annotated[JudgeReward, Tag("judge")], Annotated[SimilarityReward, Tag("similarity")],
          Annotated[HttpReward, Tag("http")]],
    Discriminator(_kind),
]
ENTRY_MODELS: dict[str, type[_Entry]] = {"function": FunctionReward, "reward_model": RewardModelReward,
                                         "judge": JudgeReward, "similarity": SimilarityReward, "http": HttpReward}
