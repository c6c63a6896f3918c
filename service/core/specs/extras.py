"""What a kind adds: sparsity reports (any kind), TracIn's selection and the joint kind's retriever."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from service.core.spec_base import _Section, reject_unused
from service.core.specs.model import RETRIEVER_PRESETS, _check_model_name


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
# Selections that compare samples with each other (a cosine, interactions): in the sgd geometry, from every
# sample's kept LoRA factors.
PAIRWISE = ("top_cosine", "greedy")


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
    score: Literal["auto", "sgd", "adam", "adam_fixed_state", "adam_prior_state"] = Field(
        "auto", description="Influence geometry: sgd <g_i, G_val>; adam <g_i, D_t * G_val>, sample i's first-order "
        "effect on the validation objective through this step's AdamW update (moments, bias correction, the batch "
        "gradient); adam_fixed_state drops D_t's moment term (the LESS preconditioner); adam_prior_state takes that "
        "preconditioner from AdamW's moments before the step alone, so it is known before the backward and streams "
        "like sgd, and ranks as well as adam_fixed_state, the best measured (docs/results.md); auto: "
        "adam_prior_state with positive and top_fraction, sgd with top_cosine and greedy (they compare samples in "
        "the sgd geometry). adam and adam_fixed_state keep every sample's LoRA factors until the batch's backward "
        "ends; a step before AdamW holds moments (the first) is scored with sgd.")
    check_prediction: bool = Field(
        True, description="Every step with an update, re-evaluate the validation objective after it and record the "
        "predicted change (tracin/predicted_delta, and the trapezoid) beside the actual one (tracin/actual_delta): "
        "a forward and backward of the validation batch after the update (and, in a model with dropout, a forward "
        "before it).")

    @property
    def geometry(self) -> Literal["sgd", "adam", "adam_fixed_state", "adam_prior_state"]:
        """The score's geometry, `auto` resolved."""
        if self.score != "auto":
            return self.score
        return "sgd" if self.selection in PAIRWISE else "adam_prior_state"

    @property
    def needs_batch_gradient(self) -> bool:
        """The score waits for the whole batch's gradient: every sample's factors are kept until it is known."""
        return self.geometry in ("adam", "adam_fixed_state")

    @model_validator(mode="after")
    def _fraction(self) -> TracInSpec:
        if self.selection in ("positive", "all"):
            reject_unused(self, "tracin", ("fraction",), unless="to selections that keep a fraction")
        if self.selection in BASELINES:
            reject_unused(self, "tracin", ("val_prompts", "val_generations", "val_regenerate_every",
                                           "check_prediction", "score"), unless="to selections by influence")
        if self.score.startswith("adam") and self.selection in PAIRWISE:
            raise ValueError(f"tracin.score {self.score!r} works with selection positive or top_fraction: "
                             f"{self.selection!r} compares samples with each other in the sgd geometry")
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


class SelectionSpec(_Section):
    """Which prompts a GRPO or TracIn step draws, before any rollout is paid for."""

    prompts: Literal["uniform", "learnability"] = Field(
        "uniform", description="`uniform`: every training prompt (or environment seed) alike, with replacement. "
        "`learnability`: in proportion to the predicted chance that a group of `grpo.num_generations` completions "
        "has rewards that differ, 1 - p^G - (1 - p)^G, from a Beta(1, 1) posterior of each prompt's pass rate "
        "updated with every group drawn for it; a prompt never drawn has the prior's (high) chance, so unseen "
        "prompts are explored. No extra rollouts; the posteriors are in the checkpoint.")
    passed_at: float = Field(0.5, description="learnability: a completion whose reward is at or above this passed.")
    floor: float = Field(0.05, gt=0.0, le=1.0, description="learnability: the least draw weight of a prompt, so a "
                         "prompt that has looked solved (or hopeless) is still drawn now and then.")

    @model_validator(mode="after")
    def _used(self) -> SelectionSpec:
        if self.prompts == "uniform":
            reject_unused(self, "selection", ("passed_at", "floor"), unless="with selection.prompts: learnability")
        return self
