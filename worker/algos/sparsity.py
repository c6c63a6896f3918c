"""Parameter-update sparsity: how much of a model a stretch of training changed, and whether the
large-magnitude part of the update alone reproduces the updated model.

Pure torch. Deltas are taken in float32 (bf16 storage would hide small updates), one parameter at
a time, and reduced into counters, so memory stays flat whatever the model size.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from service.core.sparsity import LITERATURE_TOLERANCES, ChangeStats, DiffReport, LogitAgreement, PrecisionSparsity
from worker.algos.losses import k3_kl

_LAYER = re.compile(r"\.(?:layers|h|blocks|layer)\.(\d+)\.")
_COMPONENTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "qkv_proj", "gate_up_proj", "c_attn", "c_proj", "c_fc", "query", "key", "value", "dense")


def layer_index(name: str) -> int | None:
    """Transformer block index in a parameter name.

    >>> layer_index("base_model.model.model.layers.11.self_attn.q_proj.lora_A.default.weight")
    11
    >>> layer_index("model.embed_tokens.weight") is None
    True
    """
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def component(name: str) -> str:
    """The kind of weight a parameter is: q_proj, ..., down_proj, embeddings, lm_head, norms,
    lora_A / lora_B (adapter factors), or the last module name.

    >>> component("model.layers.0.mlp.gate_proj.weight")
    'gate_proj'
    >>> component("model.layers.3.input_layernorm.weight")
    'norms'
    >>> component("base_model.model.model.layers.0.self_attn.v_proj.lora_B.default.weight")
    'lora_B'
    """
    parts = name.split(".")
    for lora in ("lora_A", "lora_B"):
        if lora in parts:
            return lora
    if "embed_tokens" in parts or "wte" in parts or "word_embeddings" in parts or "embeddings" in parts:
        return "embeddings"
    if "lm_head" in parts:
        return "lm_head"
    if any("norm" in p for p in parts):
        return "norms"
    for p in reversed(parts):
        if p in _COMPONENTS:
            return p
    return parts[-2] if len(parts) > 1 else parts[0]


@dataclass
class Counter:
    """Running totals over any number of parameters."""

    thresholds: tuple[float, ...]
    rtol: float
    numel: int = 0
    unchanged: list[int] = field(default_factory=list)  # per threshold: |delta| <= t
    unchanged_rel: int = 0  # |delta| <= rtol * |w_before|
    abs_sum: float = 0.0
    abs_max: float = 0.0
    rel_sum: float = 0.0
    sign_flips: int = 0
    fp32: list[int] = field(default_factory=lambda: [0] * len(LITERATURE_TOLERANCES))  # at LITERATURE_TOLERANCES
    bf16: list[int] = field(default_factory=lambda: [0] * len(LITERATURE_TOLERANCES))  # both sides rounded to bf16

    def __post_init__(self) -> None:
        if not self.unchanged:
            self.unchanged = [0] * len(self.thresholds)

    def add(self, before: torch.Tensor, after: torch.Tensor) -> None:
        """Fold one parameter's change in. before, after: same shape, float32. (count_nonzero: 6x faster
        than summing a bool tensor, which widens it to int64 first.)"""
        delta = after - before
        a = delta.abs()
        self.numel += a.numel()
        within = {t: int(torch.count_nonzero(a <= t)) for t in {*self.thresholds, *LITERATURE_TOLERANCES}}
        for i, t in enumerate(self.thresholds):
            self.unchanged[i] += within[t]
        wabs = before.abs()
        self.unchanged_rel += int(torch.count_nonzero(a <= self.rtol * wabs))
        self.abs_sum += float(a.sum(dtype=torch.float64))
        self.abs_max = max(self.abs_max, float(a.max()) if a.numel() else 0.0)
        self.rel_sum += float((a / wabs.clamp(min=1e-12)).sum(dtype=torch.float64))
        # a sign flip: both sides non-zero with opposite signs
        self.sign_flips += int(torch.count_nonzero((before * after) < 0))
        a16 = (after.to(torch.bfloat16).float() - before.to(torch.bfloat16).float()).abs()  # exact: both are bf16
        for i, t in enumerate(LITERATURE_TOLERANCES):
            self.fp32[i] += within[t]
            self.bf16[i] += int(torch.count_nonzero(a16 <= t))

    def merge(self, other: Counter) -> None:
        self.numel += other.numel
        self.unchanged = [a + b for a, b in zip(self.unchanged, other.unchanged)]
        self.unchanged_rel += other.unchanged_rel
        self.abs_sum += other.abs_sum
        self.abs_max = max(self.abs_max, other.abs_max)
        self.rel_sum += other.rel_sum
        self.sign_flips += other.sign_flips
        self.fp32 = [a + b for a, b in zip(self.fp32, other.fp32)]
        self.bf16 = [a + b for a, b in zip(self.bf16, other.bf16)]

    def summary(self) -> ChangeStats:
        n = max(self.numel, 1)
        return ChangeStats(
            numel=self.numel,
            sparsity={str(t): u / n for t, u in zip(self.thresholds, self.unchanged)},
            sparsity_rtol=self.unchanged_rel / n,
            mean_abs_change=self.abs_sum / n,
            max_abs_change=self.abs_max,
            mean_rel_change=self.rel_sum / n,
            sign_flip_ratio=self.sign_flips / n,
            precision=PrecisionSparsity(fp32={str(t): u / n for t, u in zip(LITERATURE_TOLERANCES, self.fp32)},
                                        bf16={str(t): u / n for t, u in zip(LITERATURE_TOLERANCES, self.bf16)}),
        )


def diff_report(
    pairs: Iterable[tuple[str, torch.Tensor, torch.Tensor]], *, thresholds: Iterable[float], rtol: float,
    primary: float,
) -> DiffReport:
    """Sparsity of the change from `before` to `after` for every (name, before, after), overall,
    per layer and per component. Tensors are converted to float32 one pair at a time."""
    thresholds = tuple(sorted(set(thresholds) | {primary}))
    total = Counter(thresholds, rtol)
    per_layer: dict[str, Counter] = {}
    per_comp: dict[str, Counter] = {}
    per_cell: dict[tuple[str, str], Counter] = {}  # (layer, component): the dashboard's heatmap
    for name, before, after in pairs:
        c = Counter(thresholds, rtol)
        c.add(before.detach().float(), after.detach().float())
        total.merge(c)
        layer = layer_index(name)
        per_layer.setdefault("other" if layer is None else str(layer), Counter(thresholds, rtol)).merge(c)
        per_comp.setdefault(component(name), Counter(thresholds, rtol)).merge(c)
        cell = ("other" if layer is None else str(layer), component(name))
        per_cell.setdefault(cell, Counter(thresholds, rtol)).merge(c)
    overall = total.summary()
    layers = sorted(per_layer, key=lambda k: (k == "other", int(k) if k.isdigit() else 0))
    grid: dict[str, dict[str, float]] = {}  # layer -> component -> sparsity at the primary threshold
    for (layer_key, comp), c in per_cell.items():
        grid.setdefault(layer_key, {})[comp] = c.summary().sparsity[str(primary)]
    return DiffReport(
        **overall.model_dump(),
        primary_threshold=primary,
        sparsity_primary=overall.sparsity[str(primary)],
        per_layer={k: per_layer[k].summary() for k in layers},
        per_component={k: v.summary() for k, v in sorted(per_comp.items())},
        per_layer_component={k: grid[k] for k in layers},
    )


def task_kl(logp0: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """KL(pi_0 || pi) from completions sampled from pi_0: the k3 estimator r - 1 - log r per token,
    r = pi / pi_0 (unbiased and non-negative under pi_0's samples). logp0, logp, mask: [B, T].
    Returns (nats per completion: the mean over completions of their token sum, nats per token)."""
    k = k3_kl(logp0.double(), logp.double()) * mask  # [B, T]
    per_completion = float(k.sum(1).mean()) if k.shape[0] else 0.0
    return per_completion, float(k.sum() / mask.sum().clamp(min=1))


def magnitude_mask(delta: torch.Tensor, threshold: float) -> torch.Tensor:
    """Keep the update entries with |delta| > threshold."""
    return delta.abs() > threshold


def random_mask_like(mask: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A uniformly random mask with exactly as many kept entries as `mask` (the density baseline)."""
    k = int(mask.sum())
    flat = torch.zeros(mask.numel(), dtype=torch.bool)
    if k:
        flat[torch.randperm(mask.numel(), generator=generator)[:k]] = True
    return flat.view_as(mask)


def logit_agreement(full: torch.Tensor, sparse: torch.Tensor, mask: torch.Tensor) -> LogitAgreement:
    """Compare logits of the fully updated model with a sparsely updated one over real positions.

    full, sparse: [B, L, V]; mask: [B, L]. KL(full || sparse) per position, cosine similarity and
    MSE of the logit vectors, and top-1 agreement, each averaged over positions where mask is 1.
    """
    m = mask.bool()
    f, s = full[m].float(), sparse[m].float()  # [N, V]
    logp_f, logp_s = torch.log_softmax(f, -1), torch.log_softmax(s, -1)
    kl = (logp_f.exp() * (logp_f - logp_s)).sum(-1).clamp(min=0.0)
    return LogitAgreement(
        kl=float(kl.mean()),
        cosine=float(torch.nn.functional.cosine_similarity(f, s, dim=-1).mean()),
        mse=float(((f - s) ** 2).mean()),
        top1_agreement=float((f.argmax(-1) == s.argmax(-1)).float().mean()),
    )
