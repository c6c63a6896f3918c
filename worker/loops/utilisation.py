"""How much of the machine a step used: model FLOPs of its phases (worker/algos/flops.py) over their
wall time, against a peak measured on the same device in the same dtype when the job starts.

    mfu/peak_tflops   a large matmul's rate here (the best of a few runs, this process's threads)
    mfu/sampling      sampling's needed FLOPs (each prompt prefilled once) / (its seconds x the peak)
    mfu/train         old and reference log-probs and every epoch's forward and backward (each prompt once
                      for the rows that share it) / (seconds x peak)

    mbu/sampling      the bytes sampling must read (the weights once a decode position of the batch, each
                      row's cached keys and values once a position) / (its seconds x the read bandwidth): decode
                      is bound by memory, so this, not mfu/sampling, says how near sampling is to its limit
    mbu/peak_gbps     a large read's rate here (GB/s, this process's threads)

A figure near 1 is at the machine's limit; sampling far below it has work to win back. Counted for
the rows the step trains on (a refilled group's discarded rows are not counted, so the sampling
figure is a lower bound with refills).
"""

from __future__ import annotations

from typing import Any

import torch

from worker.algos import flops
from worker.algos.lora import is_lora
from worker.batch import RolloutBatch
from worker.loops.rollouts import Rollouts
from worker.loops.setup import AnySpec, RLJob, Setup
from worker.machine.hardware import decoder_shape, peak_bandwidth, peak_flops
from worker.model.prefix import prompt_groups


def _lengths(batch: RolloutBatch, rows: list[int]) -> tuple[list[int], list[int]]:
    return ([int(x) for x in batch.prompt_mask[rows].sum(1).tolist()],
            [int(x) for x in batch.completion_mask[rows].sum(1).tolist()])


def sampling_bytes(shape: flops.DecoderShape, model: torch.nn.Module, batch: RolloutBatch, group: int) -> int:
    """The bytes sampling `batch` (prompt-major, `group` rows a prompt) must read (flops.sampling_bytes)."""
    prompts, completions = _lengths(batch, list(range(len(batch))))
    firsts = range(0, len(batch), group)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return flops.sampling_bytes(shape, [prompts[i] for i in firsts], [completions[i:i + group] for i in firsts],
                                weight_bytes=weights, value_bytes=next(model.parameters()).element_size())


def sampling_flops(shape: flops.DecoderShape, batch: RolloutBatch, group: int) -> int:
    """The needed FLOPs of sampling `batch` (prompt-major, `group` rows a prompt)."""
    prompts, completions = _lengths(batch, list(range(len(batch))))
    firsts = range(0, len(batch), group)
    return flops.sampling(shape, [prompts[i] for i in firsts], [completions[i:i + group] for i in firsts])


def forward_flops(shape: flops.DecoderShape, batch: RolloutBatch, rows: list[int]) -> int:
    """One teacher-forced forward over `rows` of `batch` (log-probs of their completions): the rows that
    share a prompt need its positions once."""
    if not rows:
        return 0
    prompts, completions = _lengths(batch, rows)
    groups = prompt_groups(batch.prompt_ids[rows], batch.prompt_mask[rows])
    if groups is None:
        return sum(flops.forward(shape, p, c) for p, c in zip(prompts, completions, strict=True))
    members: list[list[int]] = [[] for _ in groups.first]
    for i, g in enumerate(groups.inverse.tolist()):
        members[g].append(completions[i])
    return sum(flops.group_forward(shape, prompts[first], cs) for first, cs in zip(groups.first.tolist(), members,
                                                                                    strict=True))


def train_flops(shape: flops.DecoderShape, batch: RolloutBatch, rows: list[int], *, epochs: int, frozen_base: bool,
                old_pass: bool, ref_pass: bool) -> int:
    """Old log-probs (from the second epoch on), reference log-probs, and `epochs` forwards and backwards
    over `rows`."""
    fwd = forward_flops(shape, batch, rows)
    return epochs * flops.training(fwd, frozen_base=frozen_base) + fwd * (int(old_pass) + int(ref_pass))


def step_metrics(*, peak: float, sampling: int | None, sampling_s: float, train: int, train_s: float,
                 read: tuple[int, float] | None = None) -> dict[str, float]:
    """mfu/* (and mbu/* with `read`: sampling's bytes and the read bandwidth) of a step; sampling is left
    out when it was not measured here (None: another engine, or rows sampled during the last step)."""
    out = {"mfu/peak_tflops": peak / 1e12}
    if sampling is not None and sampling_s > 0:
        out["mfu/sampling"] = sampling / sampling_s / peak
        if read is not None:
            out |= {"mbu/sampling": read[0] / sampling_s / read[1], "mbu/peak_gbps": read[1] / 1e9}
    if train_s > 0:
        out["mfu/train"] = train / train_s / peak
    return out


def sft_step(s: Setup[AnySpec], batch: RolloutBatch, *, train_s: float) -> dict[str, float]:
    """mfu/* of a supervised step: one forward and backward over every row of the batch."""
    shape = decoder_shape(s.model)
    if shape is None:
        return {}
    train = train_flops(shape, batch, list(range(len(batch))), epochs=1, frozen_base=is_lora(s.model),
                        old_pass=False, ref_pass=False)
    peak = peak_flops(s.device, next(s.model.parameters()).dtype)
    return step_metrics(peak=peak, sampling=None, sampling_s=0.0, train=train, train_s=train_s)


def grpo_step(s: Setup[RLJob], ro: Rollouts[Any], measured: dict[str, float], *, rollout_s: float, sync_s: float,
              train_s: float) -> dict[str, float]:
    """mfu/* of a GRPO step from its batch and its clock (`measured`: the step's metrics so far)."""
    g = s.spec.grpo
    shape = decoder_shape(s.model)
    if shape is None:
        return {}
    here = s.spec.rollout.engine == "hf" and not measured.get("rollout/staleness")
    sampling = sampling_flops(shape, ro.batch, g.num_generations) if here else None
    train = train_flops(shape, ro.batch, ro.train_rows, epochs=g.epochs_per_rollout_batch, frozen_base=is_lora(s.model),
                        old_pass=g.epochs_per_rollout_batch > 1, ref_pass=g.with_reference)
    peak = peak_flops(s.device, next(s.model.parameters()).dtype)
    read = (sampling_bytes(shape, s.model, ro.batch, g.num_generations), peak_bandwidth(s.device)) if here else None
    return step_metrics(peak=peak, sampling=sampling, sampling_s=rollout_s - sync_s - measured.get("time/reward_s", 0.0),
                        train=train, train_s=train_s, read=read)
