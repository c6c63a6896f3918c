"""The policy update: old and reference log-probs, epochs of micro-batched GRPO-Clip, the optimizer step."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from service.core import tracing
from worker.algos.correction import Correction, MismatchStats, correct
from worker.algos.losses import Normaliser, SampleLosses, TokenStats, sample_losses
from worker.batch import RolloutBatch
from worker.loops.rollouts import Rollouts
from worker.loops.setup import AnySpec, RLJob, Setup, rl
from worker.loops.skeleton import Run
from worker.model.forward import batch_logprobs, micro_batches, sequence_logprobs
from worker.parallel.distributed import Ranks
from worker.training import NonFiniteUpdate, grad_norm, has_dropout

HINT = "lower the learning rate, or check the rewards and the data"


def micro(s: Setup[AnySpec], batch: RolloutBatch, rows: list[int], *, shuffle_seed: int | None = None) -> list[list[int]]:
    """The job's micro-batches of `rows` (micro_batch_size rows, micro_batch_tokens positions)."""
    g = s.spec.train
    return micro_batches(batch, rows, max_rows=g.micro_batch_size, max_tokens=g.micro_batch_tokens,
                         shuffle_seed=shuffle_seed)


def batch_normaliser(s: Setup[RLJob], mask: torch.Tensor) -> Normaliser:
    """The normaliser of the whole batch whose rows on this rank have loss mask `mask` [N, T]:
    token and sequence counts summed over ranks, the longest completion of any rank."""
    local = Normaliser.of(mask, s.spec.grpo.loss_agg)
    if s.ranks.world == 1:
        return local
    t = s.ranks.sum({"tokens": local.tokens, "sequences": local.sequences})
    return replace(local, tokens=t["tokens"], sequences=int(t["sequences"]),
                   max_len=int(s.ranks.max({"T": local.max_len})["T"]))


@tracing.traced("grpo_jobs.ref_logprobs")
def reference_logprobs(s: Setup[RLJob], batch: RolloutBatch) -> torch.Tensor | None:
    """ref_logp [N, T] under the frozen reference (the base model with the adapter disabled, or a
    copy), or None when KL is neither in the loss nor asked for."""
    if not s.spec.grpo.with_reference:
        return None
    g = s.spec.grpo
    rows = micro(s, batch, list(range(len(batch))))
    if s.ref_model is not None:
        return batch_logprobs(s.ref_model, batch, g.temperature, rows, s.device, share_prompts=s.share_prompts)
    base_only: Any = s.model.disable_adapter  # peft's: the base model alone
    with base_only():
        return batch_logprobs(s.model, batch, g.temperature, rows, s.device, share_prompts=s.share_prompts)


@tracing.traced("grpo_jobs.old_logprobs")
def old_logprobs(s: Setup[RLJob], ro: Rollouts[Any]) -> torch.Tensor | None:
    """old_logp [N, T] from a pass of the rollout copy, or None: the first epoch's forward gives them.

    The rollout copy holds exactly the policy's weights (synced at the start of the step), so the first
    training forward's detached log-probs are old_logp: computed in the very micro-batches they are
    compared in, the first epoch's ratio is exactly 1 in any dtype (a separate pass in other batches
    and padding drifts by up to 0.18 nats a token in bf16 on SmolLM2, 1e-5 in fp32), and a forward
    pass a step is saved. Only a model with dropout needs the copy's pass: its training forwards are
    noisy, the copy's (eval mode) are not."""
    g = s.spec.grpo
    if g.epochs_per_rollout_batch == 1 or not has_dropout(s.model):
        return None
    return s.engine.logprobs(ro.batch, g.micro_batch_size, g.micro_batch_tokens)


def logprob_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype sequence_logprobs gives the model's log-probs in: at least float32."""
    return torch.promote_types(next(model.parameters()).dtype, torch.float32)


def correction(s: Setup[AnySpec], batch: RolloutBatch, old: torch.Tensor, mask: torch.Tensor) -> Correction | None:
    """The engine mismatch of `batch`'s rows [n, T] (sampled by the engine; trained with old log-probs
    `old`) and its importance weights per rollout.correction; None when the engine's log-probs are
    the trainer's own (hf)."""
    if batch.sampler_logp is None:
        return None
    r = s.spec.rollout
    return correct(old.detach(), batch.sampler_logp.to(old.device), mask, mode=r.correction_mode,
                   level=r.correction_level, cap=r.correction_cap)


def losses(s: Setup[RLJob], logp: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
           norm: Normaliser, ref_logp: torch.Tensor | None, fix: Correction | None) -> SampleLosses:
    """Each sample's share of the job's loss (grpo.loss, its clip and KL, the correction's weights). [n] each."""
    g = s.spec.grpo
    return sample_losses(logp, old, advantages, mask, norm, ref_logp=ref_logp, clip_eps_low=g.clip_eps_low,
                         clip_eps_high=g.clip_eps_high, kl_coef=g.kl_coef, loss=g.loss,
                         weights=None if fix is None else fix.weights)


def clip_and_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                  scheduler: torch.optim.lr_scheduler.LRScheduler | None, *, max_norm: float | None,
                  ranks: Ranks) -> float:
    """The one optimizer step of every trained module (the policy, the retriever, a tinker session's
    model): every rank's share of the gradient summed, clipped to `max_norm` (None: not clipped), the
    optimizer and its schedule (if any: a session sets its learning rate per step) stepped. Returns the
    gradient norm before clipping."""
    ranks.reduce_gradients(params)
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if max_norm is not None else grad_norm(params)
    if not math.isfinite(norm):  # every rank summed the same gradients: every rank stops here
        raise NonFiniteUpdate(f"the gradient norm is {norm}", hint=HINT)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return norm


def optimizer_step(run: Run) -> float:
    """The policy's step (max_grad_norm); returns the gradient norm before clipping."""
    s = run.s
    params = [p for group in s.optimizer.param_groups for p in group["params"]]
    max_norm = s.spec.train.max_grad_norm
    if s.sharded:  # FSDP2 summed each backward's gradient into this rank's shards; the norm is over all of them
        total = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
        shards: Any = total  # a DTensor of the shards' norms
        norm = float(shards.full_tensor())
        if not math.isfinite(norm):
            raise NonFiniteUpdate(f"the gradient norm is {norm}", step=run.step, hint=HINT)
        s.optimizer.step()
        s.scheduler.step()
    else:
        try:
            norm = clip_and_step(params, s.optimizer, s.scheduler, max_norm=max_norm, ranks=s.ranks)
        except NonFiniteUpdate as exc:  # the step the run is at, for the flag
            raise NonFiniteUpdate(exc.what, step=run.step, hint=HINT) from None
    run.after_optimizer_step()
    return norm


@dataclass
class PassTotals:
    """One pass over a batch: its loss (the sum of its samples' shares) and token statistics."""

    loss: float = 0.0
    policy: float = 0.0
    kl: float | None = None  # None: no reference, not measured
    tokens: TokenStats = field(default_factory=TokenStats)
    entropy_sum: float = 0.0  # over real tokens
    mismatch: MismatchStats | None = None  # engine vs trainer log-probs (vllm); one pass's, never summed over epochs

    def __iadd__(self, other: PassTotals) -> PassTotals:
        self.loss += other.loss
        self.policy += other.policy
        if other.kl is not None:
            self.kl = (self.kl or 0.0) + other.kl
        self.tokens += other.tokens
        self.entropy_sum += other.entropy_sum
        self.mismatch = self.mismatch or other.mismatch  # the first epoch's: the later ones see the same tokens
        return self

    def reduced(self, ranks: Ranks) -> PassTotals:
        """The totals of every rank's share of the batch."""
        t = ranks.sum({"loss": self.loss, "policy": self.policy, "kl": self.kl or 0.0, "tokens": self.tokens.tokens,
                       "ratio_sum": self.tokens.ratio_sum, "clipped": self.tokens.clipped, "entropy": self.entropy_sum})
        ratio_max = ranks.max({"ratio_max": self.tokens.ratio_max})["ratio_max"]
        mismatch = None
        if self.mismatch is not None:
            m = self.mismatch
            mt = ranks.sum({"tokens": m.tokens, "abs_sum": m.abs_sum, "changed": m.changed})
            mismatch = MismatchStats(tokens=mt["tokens"], abs_sum=mt["abs_sum"], changed=mt["changed"],
                                     abs_max=ranks.max({"m": m.abs_max})["m"],
                                     log_ratios=[ranks.cat(m.ratios())])
        return PassTotals(loss=t["loss"], policy=t["policy"], kl=None if self.kl is None else t["kl"],
                          tokens=TokenStats(t["tokens"], t["ratio_sum"], ratio_max, t["clipped"]),
                          entropy_sum=t["entropy"], mismatch=mismatch)

    def metrics(self) -> dict[str, float]:
        """The pass's metrics; reduce it first with several processes (the mismatch's quantiles need
        every rank's ratios)."""
        out = {"loss/total": self.loss, "loss/policy": self.policy, **self.tokens.metrics(),
               "entropy": self.entropy_sum / max(self.tokens.tokens, 1.0)}
        if self.kl is not None:
            out["kl"] = self.kl
        if self.mismatch is not None:
            out.update(self.mismatch.metrics(self.mismatch.ratios()))
        return out


def backward_pass(s: Setup[RLJob], ro: Rollouts[Any], micro: list[list[int]], norm: Normaliser, old_logp: torch.Tensor | None,
                  ref_logp: torch.Tensor | None, step: int, *, with_entropy: bool = True,
                  before: Callable[[list[int]], None] | None = None,
                  after: Callable[[], None] | None = None, record: torch.Tensor | None = None) -> PassTotals:
    """Forward and backward of each micro-batch's samples' shares of the loss normalised by `norm`;
    gradients accumulate in .grad. `before(rows)` / `after()` run around each micro-batch (TracIn's
    hooks). old_logp None: the first epoch, whose weights are the rollout copy's, so old = logp.detach()
    (kept in `record` [N, T] for the later epochs)."""
    g = s.spec.grpo
    out = PassTotals(kl=None if ref_logp is None else 0.0)
    mismatch = out.mismatch = MismatchStats() if ro.batch.sampler_logp is not None else None
    for idx in micro:
        mb = ro.batch.select(idx).to(s.device)
        mask = ro.loss_mask[idx].to(s.device)
        if before is not None:
            before(idx)
        logp, e = sequence_logprobs(s.model, mb, g.temperature, with_entropy=with_entropy,
                                    share_prompts=s.share_prompts)
        old = logp.detach() if old_logp is None else old_logp[idx].to(s.device)
        if record is not None:
            record[idx] = old.to(record.device, record.dtype)
        fix = correction(s, mb, old, mask)
        parts = losses(s, logp, old, ro.advantages[idx].to(s.device), mask, norm,
                       None if ref_logp is None else ref_logp[idx].to(s.device), fix)
        if fix is not None and mismatch is not None:
            mismatch.add(fix, mask)
        loss = parts.loss.sum()
        if not torch.isfinite(loss):
            raise NonFiniteUpdate(f"the loss is {loss.item()}", step=step, hint=HINT)
        loss.backward()
        if after is not None:
            after()
        out.loss += float(loss.detach())
        out.policy += float(parts.policy.sum())
        if parts.kl is not None:
            out.kl = (out.kl or 0.0) + float(parts.kl.sum())
        out.tokens += parts.tokens
        out.entropy_sum += float((e * mask).sum()) if e is not None else 0.0
    return out


@tracing.traced("rl.train")
def train_epochs(run: Run, ro: Rollouts[Any], old_logp: torch.Tensor | None, ref_logp: torch.Tensor | None, step: int,
                 *, rows: list[int] | None = None, norm_rows: list[int] | None = None) -> dict[str, float]:
    """epochs_per_rollout_batch passes over `rows` of the batch (default: its train_rows), each one
    optimizer step with gradient accumulation over micro-batches. Every micro-batch's loss is its
    samples' shares of the loss of `norm_rows` (default: `rows`), so the accumulated gradient is that
    loss's gradient; TracIn passes all rows as norm_rows, so selected samples keep their weight.
    Losses are the mean over epochs; ratio, clip and entropy statistics over every epoch's tokens."""
    s = rl(run.s)
    g = s.spec.grpo
    rows = ro.train_rows if rows is None else rows
    norm = batch_normaliser(s, ro.loss_mask[norm_rows if norm_rows is not None else rows])
    s.model.train()
    epochs = PassTotals()  # summed over epochs; losses reported as their mean
    norms = []
    # old_logp None: the first epoch's own log-probs are the later epochs' old_logp
    first = torch.zeros(ro.batch.completion_ids.shape, dtype=logprob_dtype(s.model)) if old_logp is None else None
    for epoch in range(g.epochs_per_rollout_batch):
        s.optimizer.zero_grad(set_to_none=True)
        seed = None if epoch == 0 else hash((g.seed, step, epoch)) % 2**31
        epochs += backward_pass(s, ro, micro(s, ro.batch, rows, shuffle_seed=seed), norm, old_logp,
                                ref_logp, step, record=first if epoch == 0 and g.epochs_per_rollout_batch > 1 else None)
        norms.append(optimizer_step(run))
        if first is not None:
            old_logp = first
    n = g.epochs_per_rollout_batch
    out = epochs.reduced(s.ranks).metrics()
    out.update({k: out[k] / n for k in ("loss/total", "loss/policy", "kl") if k in out})
    out.update({"grad_norm": sum(norms) / len(norms), "lr": float(s.scheduler.get_last_lr()[0])})
    return out
