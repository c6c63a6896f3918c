"""Sparsity reports for any loop: every `measure_interval` optimizer steps, diff the trained
parameters against the previous measurement (the window) and against the start (cumulative),
and test whether the large-magnitude part of the window's update reproduces the updated model.

Each report also gives the unchanged shares in float32 and bfloat16 at the literature's tolerances,
and KL(pi_0 || pi) on held-out task prompts: pi_0 samples one completion per prompt at the start,
and each measurement scores those tokens under the current policy.

Snapshots are CPU copies in float32 (float64 for float64 weights): the start, and the previous
measurement (the two are one copy until the first measurement). With LoRA, the adapter factors
are tracked, and so is the effective merged weight W0 + s * B @ A of each adapted matrix, which is what the base model sees.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from service.core.records import SparsityRecord
from service.core.sparsity import QualityRow, SparsityReport
from service.core.specs import SparsitySpec
from worker.algos.lora import lora_layers
from worker.algos.sparsity import (
    diff_report,
    logit_agreement,
    magnitude_mask,
    random_mask_like,
    task_kl,
)
from worker.batch import RolloutBatch
from worker.datasets import render_example
from worker.model.forward import batch_logprobs, micro_batches
from worker.reporting import Reporter
from worker.training import eval_mode, step_seed


def _cpu_copy(p: torch.Tensor) -> torch.Tensor:
    """A CPU copy in at least float32: exact for float32 and float64 weights, so restoring one is exact."""
    if isinstance(p, DTensor):  # sharded (FSDP2): gathered whole, a collective every rank calls
        p = p.full_tensor()
    return p.detach().to("cpu", torch.promote_types(p.dtype, torch.float32), copy=True)


@dataclass(frozen=True)
class TaskProbe:
    """pi_0's own completions of held-out task prompts, and their log-probs under pi_0."""

    batch: RolloutBatch  # [B] rows, one completion per prompt
    logp0: torch.Tensor  # [B, T]


@dataclass(frozen=True)
class ProbeBatch:
    """The validation texts the quality probe runs the model on, left-padded."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    position_ids: torch.Tensor  # [B, L]


class SparsityTracker:
    def __init__(self, spec: SparsitySpec, setup, reporter: Reporter, *, start_step: int = 0) -> None:
        """setup: the loop's Setup (model, tokenizer, task, spec); start_step: optimizer steps already taken."""
        self.spec, self.s, self.reporter = spec, setup, reporter
        self.params = [(n, p) for n, p in setup.model.named_parameters() if p.requires_grad]
        # A sharded model's ranks all gather each snapshot; rank 0 alone keeps it and reports.
        self.keeps = setup.ranks.main
        self.start = self._snapshot()
        self.prev = self.start  # the same tensors until the first measurement
        self.start_step = self.prev_step = start_step
        self.lora_modules = [(layer.name, layer.module) for layer in lora_layers(setup.model)]
        self.start_merged = {n: self._merged(m, self.start, n) for n, m in self.lora_modules}
        self.prev_merged = self.start_merged
        self.pending: dict[str, float] = {}
        self.probe = self._probe_batch()
        self.task = self._task_probe()

    def _snapshot(self) -> dict[str, torch.Tensor]:
        """The trained parameters as CPU copies in at least float32 (on rank 0; gathered by every rank)."""
        out = {}
        for n, p in self.params:
            t = _cpu_copy(p)
            if self.keeps:
                out[n] = t
        return out

    # -- LoRA merged view ----------------------------------------------------------------------
    def _merged(self, module, snapshot: dict[str, torch.Tensor], mname: str) -> torch.Tensor:
        """W0 + s * B @ A in at least float32 on CPU for one adapted module, from a snapshot of A and B."""
        a = snapshot[f"{mname}.lora_A.default.weight"]
        b = snapshot[f"{mname}.lora_B.default.weight"]
        w0 = _cpu_copy(module.base_layer.weight)
        return w0 + module.scaling["default"] * (b @ a)

    # -- probe batch ---------------------------------------------------------------------------
    def _probe_batch(self) -> ProbeBatch | None:
        if not self.spec.quality.enabled:
            return None
        s = self.s
        tok = s.tokenizer
        texts = [render_example(tok, ex, s.task.instruction, chat=s.spec.dataset.chat_template)
                 + " " + ex.answers[0] for ex in s.task.val[: self.spec.quality.probe_size]]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        mask = enc["attention_mask"]
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        return ProbeBatch(input_ids=enc["input_ids"].to(s.device), attention_mask=mask.to(s.device),
                          position_ids=pos.to(s.device))

    # -- KL to the starting policy on the task --------------------------------------------------
    def _micro(self, batch: RolloutBatch) -> list[list[int]]:
        g = self.s.spec.train
        return micro_batches(batch, list(range(len(batch))), max_rows=g.micro_batch_size,
                             max_tokens=g.micro_batch_tokens)

    def _task_probe(self) -> TaskProbe | None:
        """Every rank samples the same completions (a sharded model's forwards run in lockstep)."""
        s, n = self.s, self.spec.kl_prompts
        examples = s.task.val[:n]
        if not examples:
            return None
        prompts = [render_example(s.tokenizer, ex, s.task.instruction, chat=s.spec.dataset.chat_template)
                   for ex in examples]
        s.engine.sync(s.model)
        seed = step_seed(s.spec.train.seed, -1)  # a stream no training step draws from
        batch = s.engine.generate(prompts, 1, seeds=[seed + i for i in range(len(prompts))])
        return TaskProbe(batch=batch, logp0=self._task_logprobs(batch))

    def _task_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        with eval_mode(self.s.model):
            return batch_logprobs(self.s.model, batch, self.s.engine.params.temperature, self._micro(batch),
                                  self.s.device)

    def _kl_task(self) -> tuple[float, float] | None:
        if self.task is None:
            return None
        logp = self._task_logprobs(self.task.batch)
        return task_kl(self.task.logp0, logp, self.task.batch.completion_mask.to(logp.device))

    @torch.no_grad()
    def _probe_logits(self) -> torch.Tensor:
        p = self.probe
        return self.s.model(input_ids=p.input_ids, attention_mask=p.attention_mask, position_ids=p.position_ids,
                            use_cache=False).logits.float()

    # -- measurement ---------------------------------------------------------------------------
    def on_optimizer_step(self, opt_step: int) -> None:
        if (opt_step - self.start_step) % self.spec.measure_interval == 0:
            self.measure(opt_step)

    def pop_metrics(self) -> dict[str, float]:
        out, self.pending = self.pending, {}
        return out

    @torch.no_grad()
    def measure(self, step: int) -> None:
        t0 = time.perf_counter()
        after = self._snapshot()
        kl = self._kl_task()  # on every rank: a sharded model's forward is a collective
        if not self.keeps:
            return
        merged_after = {n: self._merged(m, after, n) for n, m in self.lora_modules}
        window = self._report(self.prev, self.prev_merged, after, merged_after)
        cumulative = self._report(self.start, self.start_merged, after, merged_after)
        quality = self._quality(after, step) if self.probe is not None else None
        dt = time.perf_counter() - t0
        kl_fields = {} if kl is None else {"kl_task": kl[0], "kl_task_per_token": kl[1]}
        window = window.model_copy(update={"quality": quality, "time_s": dt, **kl_fields})
        cumulative = cumulative.model_copy(update={"time_s": dt, **kl_fields})
        for scope, rep, frm in (("window", window, self.prev_step), ("cumulative", cumulative, self.start_step)):
            self.reporter.sparsity(SparsityRecord(step=step, from_step=frm, scope=scope,
                                                  sparsity=rep.sparsity_primary, report=rep))
        self.pending.update({"sparsity/ratio": window.sparsity_primary,
                             "sparsity/sign_flip_ratio": window.sign_flip_ratio,
                             "sparsity/cumulative_ratio": cumulative.sparsity_primary,
                             "sparsity/time_s": dt, **({} if kl is None else {"sparsity/kl_task": kl[0]})})
        self.prev, self.prev_merged, self.prev_step = after, merged_after, step

    def _report(self, before: dict[str, torch.Tensor], merged_before: dict[str, torch.Tensor],
                after: dict[str, torch.Tensor], merged_after: dict[str, torch.Tensor]) -> SparsityReport:
        """The change from a snapshot to `after`, and with LoRA of the merged weights too."""
        sp = self.spec
        kw = dict(thresholds=sp.thresholds, rtol=sp.rtol, primary=sp.primary_threshold)
        trained = diff_report(((n, before[n], after[n]) for n, _ in self.params), **kw)
        merged = None
        if self.lora_modules:
            merged = diff_report(((f"{n}.weight", merged_before[n], merged_after[n])
                                  for n, _ in self.lora_modules), **kw)
        return SparsityReport(**trained.model_dump(), merged=merged)

    def _quality(self, after: dict[str, torch.Tensor], step: int) -> list[QualityRow]:
        """Apply only part of the window's update, forward the probe, compare with the full update.
        The weights are restored from `after`, bit for bit, before returning."""
        model = self.s.model
        was_training = model.training
        model.eval()
        full = self._probe_logits()
        mask = self.probe.attention_mask
        gen = torch.Generator().manual_seed(step)
        rows = []
        try:
            for t in (self.spec.quality.thresholds or self.spec.thresholds):
                kept = total = 0
                res = {}
                masks = {}
                for n, _ in self.params:
                    delta = after[n] - self.prev[n]
                    masks[n] = magnitude_mask(delta, t)
                    kept += int(masks[n].sum())
                    total += delta.numel()
                for kind in ("magnitude", "random"):
                    for n, p in self.params:
                        m = masks[n] if kind == "magnitude" else random_mask_like(masks[n], gen)
                        partial = self.prev[n] + (after[n] - self.prev[n]) * m
                        p.copy_(partial.to(p.device, p.dtype))
                    res[kind] = logit_agreement(full, self._probe_logits(), mask)
                rows.append(QualityRow(threshold=t, density=kept / max(total, 1), **res))
        finally:
            for n, p in self.params:  # exact: `after` holds the weights' own values
                p.copy_(after[n].to(p.device, p.dtype))
            model.train(was_training)
        return rows
