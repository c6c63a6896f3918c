"""The sparsity report: one record from the algorithm that measures it (`worker/algos/sparsity.py`)
through the store's JSON column to the API's schema and the dashboard.

Pydantic models, so a stored report reads back typed and the OpenAPI page documents every field.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# A change statistic of a diverged model can be NaN or infinite; JSON has neither, so it reads null.
Measured = Annotated[float | None, Field(description="null where the value was not finite.")]


class _Report(BaseModel):
    # Extra keys are kept, not refused: a report stored by another version still reads back whole.
    model_config = ConfigDict(extra="allow")


# The tolerances the literature reports unchanged parameters at (|delta| <= t), in both precisions.
LITERATURE_TOLERANCES = (0.0, 1e-5, 1e-4)


class PrecisionSparsity(_Report):
    """Unchanged shares at LITERATURE_TOLERANCES, keyed by the tolerance as text ("0.0", "1e-05", "0.0001")."""

    fp32: dict[str, float] = Field(description="|after - before| <= t, compared in float32 (float64 weights: float64).")
    bf16: dict[str, float] = Field(description="|bf16(after) - bf16(before)| <= t: both snapshots rounded to bfloat16 "
                                   "first, as released checkpoints are compared; rounding hides updates smaller than "
                                   "half a bf16 step (2^-8 of the weight's magnitude).")


class ChangeStats(_Report):
    """How much one set of parameters changed from `before` to `after`, elementwise."""

    numel: int = Field(description="Elements compared.")
    sparsity: dict[str, float] = Field(description="Per threshold t (as text): share of elements with |delta| <= t.")
    sparsity_rtol: float = Field(description="Share of elements with |delta| <= rtol * |w_before|.")
    mean_abs_change: Measured
    max_abs_change: Measured
    mean_rel_change: Measured
    sign_flip_ratio: float = Field(description="Share of elements whose sign flipped (both sides non-zero).")
    precision: PrecisionSparsity | None = Field(None, description="Unchanged shares in float32 and in bfloat16 at "
                                                "the literature's tolerances (null in reports stored before them).")


class DiffReport(ChangeStats):
    """The change of a whole model, overall (the inherited fields), per layer and per component."""

    primary_threshold: float
    sparsity_primary: float = Field(description="`sparsity` at the primary threshold.")
    per_layer: dict[str, ChangeStats] = Field(description="By transformer block index ('other' outside blocks).")
    per_component: dict[str, ChangeStats] = Field(description="By weight kind: q_proj, ..., lora_A, norms.")
    per_layer_component: dict[str, dict[str, float]] = Field(
        description="layer -> component -> sparsity at the primary threshold (the dashboard's heatmap).")


class LogitAgreement(_Report):
    """The probe's logits under a partial update against the full update, averaged over real positions."""

    kl: Measured  # KL(full || partial) per position
    cosine: Measured
    mse: Measured
    top1_agreement: float


class QualityRow(_Report):
    """The window's update kept only where |delta| > threshold (magnitude), or as many entries at random."""

    threshold: float
    density: float = Field(description="Share of the update's entries kept.")
    magnitude: LogitAgreement
    random: LogitAgreement


class SparsityReport(DiffReport):
    """One measurement of the trained parameters; with LoRA also of the merged weights W0 + s * B @ A."""

    merged: DiffReport | None = Field(None, description="LoRA only: the change of the effective merged weights.")
    quality: list[QualityRow] | None = Field(None, description="Window reports with the quality probe on.")
    time_s: float | None = Field(None, description="Seconds the measurement took.")
    kl_task: Measured = Field(None, description="KL(pi_0 || pi) on held-out task prompts, nats per completion: the "
                              "policy against the one the job started from (in both scopes), estimated from pi_0's "
                              "own samples (sparsity.kl_prompts, drawn once at the start) with the k3 estimator.")
    kl_task_per_token: Measured = Field(None, description="kl_task per completion token.")
