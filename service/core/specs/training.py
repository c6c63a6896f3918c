"""How a job trains: the loop's shared schedule (steps, learning rate, evaluation, checkpoints), and
GRPO's and SFT's own knobs."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from service.core.loss_names import LossAgg, LossName
from service.core.spec_base import _Section, reject_unused


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
    share_prompts: bool = Field(
        True, description="Teacher-forced forwards (training, old and reference log-probs) compute a group's prompt "
        "once and go on from it for each completion: the same gradients to rounding, for a third of the positions "
        "on the matched spec. false: one forward per row, whose rounding does not depend on how rows are grouped "
        "in micro-batches and processes. TracIn shares too, taking each row's own part of the prompt's gradient from "
        "leaves of its own (exact: worker/model/prefix.py), except with dropout or a selection that compares samples "
        "with each other (top_cosine, greedy); sharded policies always run one forward per row.")

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
