"""The policy's teacher-forced forward: per-token log-probs (and entropy) of a batch's completions.

What the loss's log-probs come from: the decoder runs over prompt + completion once (rows that share a
prompt share its forward, worker/model/prefix.py), and the head's log-softmax runs over the real
completion tokens a chunk at a time (worker/algos/logprobs.py), never as an [N, T, V] tensor. Models whose
logits are more than `lm_head(hidden)` take the full-logits path. Used by the update, the sparsity and
influence passes, SFT and the samplers' `logprobs`.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from worker.algos.logprobs import Float32Head, token_logprobs
from worker.algos.losses import entropy_from_logits
from worker.batch import RolloutBatch
from worker.model.prefix import completion_hidden, teacher_forced


def micro_batches(batch: RolloutBatch, rows: list[int], *, max_rows: int, max_tokens: int | None = None,
                  shuffle_seed: int | None = None) -> list[list[int]]:
    """`rows` of `batch` in micro-batches of at most `max_rows` rows and, given `max_tokens`, at most
    that many positions once padding is dropped (rows x (longest prompt + longest completion)); a row
    longer than `max_tokens` goes alone. Shuffled first when a seed is given, then packed in order."""
    order = list(rows)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    prompt = batch.prompt_mask.sum(1).tolist()  # [N]
    completion = batch.completion_mask.sum(1).tolist()  # [N]
    out: list[list[int]] = []
    p = c = 0  # the open micro-batch's longest prompt and completion
    for r in order:
        wp, wc = max(p, prompt[r]), max(c, completion[r])
        full = out and (len(out[-1]) >= max_rows or
                        max_tokens is not None and (len(out[-1]) + 1) * (wp + wc) > max_tokens)
        if not out or full:
            out.append([])
            wp, wc = prompt[r], completion[r]
        out[-1].append(r)
        p, c = wp, wc
    return out


@torch.no_grad()
def batch_logprobs(model: torch.nn.Module, batch: RolloutBatch, temperature: float, micro: list[list[int]],
                   device: torch.device | str, *, share_prompts: bool = False) -> torch.Tensor:
    """logp [N, T] of every row of `batch` under `model`, micro-batch by micro-batch, without gradient."""
    out = torch.zeros(batch.completion_ids.shape, device=device)
    for rows in micro:
        lp = sequence_logprobs(model, batch.select(rows).to(device), temperature,
                               share_prompts=share_prompts)[0]  # [n, T]
        out = out.to(lp.dtype)  # float64 models keep float64
        out[rows] = lp
    return out


# Configs whose CausalLM does more to the head's output than `lm_head(hidden)`: those keep the full logits.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def split_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """(decoder, lm_head) where the model's logits are exactly `lm_head(decoder(...).last_hidden_state)`
    with a plain, unsharded linear head; None otherwise (those models keep the full-logits path)."""
    base: Any = getattr(model, "get_base_model", lambda: model)()  # peft: the wrapped model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    if type(head) not in (torch.nn.Linear, Float32Head) or decoder is None or decoder is base:
        return None  # no head, or an adapter on the head itself
    assert isinstance(head, torch.nn.Linear) and isinstance(decoder, torch.nn.Module)
    if isinstance(head.weight, DTensor) or any(getattr(base.config, k, None) for k in _LOGIT_TRANSFORMS):
        return None  # FSDP2 unshards the head only inside the root's forward
    return decoder, head


def forward_inputs(b: RolloutBatch) -> dict[str, torch.Tensor | bool]:
    """prefix.teacher_forced of the batch's rows [N, P+T]."""
    return teacher_forced(b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask)


def sequence_logprobs(
    model: torch.nn.Module, batch: RolloutBatch, temperature: float, *, with_entropy: bool = False,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of the completion tokens under `model`, logits / temperature.

    Returns logp [N, T] (0 at masked positions) and, if asked, the per-token entropy [N, T].
    Columns that are padding in every row are dropped first, and the head runs over the real
    completion tokens a chunk at a time (worker/algos/logprobs.py): no [N, T, V] tensor exists.
    `share_prompts`: rows with the same prompt share its forward (worker/model/prefix.py).
    """
    N, T = batch.completion_ids.shape
    b = batch.trimmed()
    t = b.completion_ids.shape[1]
    parts = split_head(model)
    if parts is None:
        logp, ent = _logprobs_from_logits(model, b, forward_inputs(b), temperature, with_entropy)
    else:
        decoder, head = parts
        hidden = completion_hidden(decoder, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                                   share=share_prompts)  # [N, t, H]: position P-1+j predicts token j
        real = b.completion_mask.bool()  # [N, t]
        lp, e = token_logprobs(hidden[real], head.weight, head.bias, b.completion_ids[real], temperature=temperature,
                               with_entropy=with_entropy, head_dtype=getattr(head, "compute_dtype", None))  # [M]
        logp = torch.zeros(N, t, dtype=lp.dtype, device=lp.device).masked_scatter(real, lp)
        ent = None if e is None else torch.zeros(N, t, dtype=e.dtype, device=e.device).masked_scatter(real, e)
    pad = (0, T - t)
    return torch.nn.functional.pad(logp, pad), None if ent is None else torch.nn.functional.pad(ent, pad)


def _logprobs_from_logits(model: torch.nn.Module, b: RolloutBatch, kw: dict[str, Any], temperature: float,
                          with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The full-logits path, for models `split_head` cannot split: logp, entropy [N, t]."""
    t = b.completion_ids.shape[1]
    # Only the last t+1 positions need the LM head: the prompt's logits would be thrown away.
    logits = model(**kw, logits_to_keep=t + 1).logits[:, -(t + 1):-1, :]  # [N, t, V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least float32, float64 kept
    if temperature != 1.0:
        logits = logits / temperature
    # logit[token] - logsumexp(logits): no [N, t, V] log_softmax tensor is kept for backward
    logp = logits.gather(-1, b.completion_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    logp = logp * b.completion_mask  # [N, t]
    ent = None
    if with_entropy:
        with torch.no_grad():  # one sequence at a time: never more than one [t, V] temporary
            ent = torch.stack([entropy_from_logits(row) for row in logits.detach()]) * b.completion_mask
    return logp, ent
