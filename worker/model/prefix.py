"""A group's prompt computed once in a teacher-forced forward: the G completions of a prompt share its
keys and values, so the prompt's positions go through the decoder once per distinct prompt, and each row
goes on from a copy of its prompt's cache with its completion only.

GRPO's rows come in groups of G completions of one prompt. Each row's forward otherwise recomputes the
prompt: on a matched-spec batch (4 prompts x 8 completions of up to 24 tokens) that is 2,478 positions
where 920 are distinct (bench/prefix.py). Gradients reach the prompt's positions through the copy (an index, whose
backward sums the G rows' gradients), so the loss, the log-probs and every gradient are those of the
per-row forward, to rounding.

Not for: gradient checkpointing (transformers drops the cache of a checkpointed layer), caches that are not
plain full attention (sliding windows), and per-sample hooks that expect one row per sample in every
forward (TracIn's): the caller says when rows may share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


@dataclass(frozen=True)
class PromptGroups:
    """Which rows share a prompt."""

    first: torch.Tensor  # [U] one row of each distinct prompt
    inverse: torch.Tensor  # [N] each row's prompt, an index into `first`


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> PromptGroups | None:
    """The distinct prompts of left-padded rows [N, P]; None where no two rows share one."""
    n = prompt_ids.shape[0]
    rows = torch.cat([prompt_ids * prompt_mask, prompt_mask], dim=1)  # [N, 2P]: what a pad holds does not count
    distinct, inverse = torch.unique(rows, dim=0, return_inverse=True)  # [U, 2P], [N]
    if len(distinct) == n:
        return None
    first = torch.full((len(distinct),), n, dtype=torch.long, device=inverse.device)
    first = first.scatter_reduce(0, inverse, torch.arange(n, device=inverse.device), reduce="amin")  # [U]
    return PromptGroups(first=first, inverse=inverse)


def checkpointing(decoder: torch.nn.Module) -> bool:
    """Whether a training forward of `decoder` recomputes its layers (and so keeps no cache)."""
    return torch.is_grad_enabled() and decoder.training and any(
        getattr(m, "gradient_checkpointing", False) for m in decoder.modules())


def teacher_forced(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                   completion_mask: torch.Tensor) -> dict[str, torch.Tensor | bool]:
    """The model's keyword inputs for prompt + completion rows [N, P+T]: positions count real tokens
    only, as generate() does with left padding; no KV cache."""
    attn = torch.cat([prompt_mask, completion_mask], dim=1)  # [N, P+T]
    return dict(input_ids=torch.cat([prompt_ids, completion_ids], dim=1), attention_mask=attn,
                position_ids=(attn.long().cumsum(1) - 1).clamp(min=0), use_cache=False)


def completion_hidden(decoder: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      completion_ids: torch.Tensor, completion_mask: torch.Tensor, *,
                      share: bool) -> torch.Tensor:
    """The decoder's last hidden states [N, t, H] that predict completion tokens 0..t-1 (the positions
    P-1 .. P+t-2 of prompt + completion). `share`: rows with the same prompt share its forward, where the
    model and its mode allow (module docstring)."""
    P, t = prompt_ids.shape[1], completion_ids.shape[1]
    kw = teacher_forced(prompt_ids, prompt_mask, completion_ids, completion_mask)  # [N, P+t]
    groups = prompt_groups(prompt_ids, prompt_mask) if share and P > 0 and t > 0 else None
    config: Any = decoder.config  # transformers' PreTrainedConfig, untyped on a Module
    cache = DynamicCache(config=config) if groups is not None else None
    if groups is None or cache is None or checkpointing(decoder) or \
            any(type(layer) is not DynamicLayer for layer in cache.layers):
        hidden: torch.Tensor = decoder(**kw).last_hidden_state
        return hidden[:, P - 1:P + t - 1]  # [N, t, H]
    attn, positions = kw["attention_mask"], kw["position_ids"]
    assert isinstance(attn, torch.Tensor) and isinstance(positions, torch.Tensor)
    f = groups.first
    prompt: torch.Tensor = decoder(input_ids=prompt_ids[f], attention_mask=prompt_mask[f], position_ids=positions[f, :P],
                     cache=cache, use_cache=True).last_hidden_state  # [U, P, H]
    first_token = prompt[groups.inverse, -1:]  # [N, 1, H]: the prompt's last position predicts token 0
    if t == 1:
        return first_token
    cache.batch_select_indices(groups.inverse)  # each row's copy of its prompt's keys and values [N, ...]
    rest: torch.Tensor = decoder(input_ids=completion_ids[:, :-1], attention_mask=attn[:, :-1], position_ids=positions[:, P:-1],
                   cache=cache, use_cache=True).last_hidden_state  # [N, t-1, H]: token j predicts token j+1
    return torch.cat([first_token, rest], dim=1)
