"""A group's prompt computed once in a teacher-forced forward: the G completions of a prompt share its
keys and values, so the prompt's positions go through the decoder once per distinct prompt, and each row
goes on from a copy of its prompt's cache with its completion only.

GRPO's rows come in groups of G completions of one prompt. Each row's forward otherwise recomputes the
prompt: on a matched-spec batch (4 prompts x 8 completions of up to 24 tokens) that is 2,478 positions
where 920 are distinct (bench/prefix.py). Gradients reach the prompt's positions through the copy (an index, whose
backward sums the G rows' gradients), so the loss, the log-probs and every gradient are those of the
per-row forward, to rounding.

Not for: gradient checkpointing (transformers drops the cache of a checkpointed layer) and caches that are
not plain full attention (sliding windows): the caller says when rows may share.

Per-sample gradients (TracIn's hooks, worker/algos/influence.py) need each row's own share of the prompt's
gradient, which the shared forward's backward sums over the group. Inside `taped_prompts()` the prompt's
forward runs without a graph instead, and each row goes on from its own leaf copy of its prompt's keys,
values and last hidden state: after backward, a leaf's .grad is that row's gradient there alone. What the
prompt's positions add to a row's gradient is then a product with those leaves (`PromptPart`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, cast

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


@dataclass(frozen=True)
class PromptPart:
    """One shared forward's distinct prompts, run without a graph, and its rows' leaves."""

    decoder: torch.nn.Module
    inputs: dict[str, torch.Tensor]  # the prompts' forward: input_ids, attention_mask, position_ids [U, P]
    inverse: torch.Tensor  # [N] each row's prompt
    leaves: list[torch.Tensor]  # per row: every layer's keys and values [N, h, P, d], then the last hidden [N, 1, H]

    def outputs(self, weights: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The prompts' keys and values and last hidden state [U, ...], in `leaves`' order, from a forward
        with the current weights, or with `weights` (name -> tensor) in place of some (in a graph where grad is
        enabled, for a backward through the prompts)."""
        from torch.func import functional_call

        config: Any = self.decoder.config
        cache = DynamicCache(config=config)
        kw = {**self.inputs, "cache": cache, "use_cache": True}
        out = self.decoder(**kw) if weights is None else functional_call(self.decoder, weights, (), kw)
        return [*keys_values(cache), out.last_hidden_state[:, -1:]]  # [U, P, H] -> its last position

    @property
    def width(self) -> int:
        """P, the prompts' positions (left-padded)."""
        return int(self.inputs["input_ids"].shape[1])

    def chunks(self, size: int) -> list[tuple[slice, PromptPart]]:
        """The prompts `size` at a time, each chunk at the whole part's width and without leaves: a backward
        through all of them at once would hold every prompt's activations together."""
        u = len(self.inputs["input_ids"])
        return [(slice(i, i + size), PromptPart(self.decoder, {k: v[i:i + size] for k, v in self.inputs.items()},
                                                torch.arange(min(size, u - i), device=self.inverse.device), []))
                for i in range(0, u, size)]

    def keys(self) -> list[tuple[int, ...]]:
        """Each distinct prompt's real tokens."""
        ids, mask = self.inputs["input_ids"], self.inputs["attention_mask"].bool()
        return [tuple(row[m].tolist()) for row, m in zip(ids, mask)]

    def of(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> PromptPart:
        """The distinct prompts of left-padded rows [n, P], as a shared forward of this decoder runs them
        (no leaves; columns that are padding in every row dropped)."""
        real = prompt_mask.bool().any(0)
        ids, mask = prompt_ids[:, real], prompt_mask[:, real]
        groups = prompt_groups(ids, mask)
        first = torch.arange(len(ids), device=ids.device) if groups is None else groups.first
        positions = (mask.long().cumsum(1) - 1).clamp(min=0)  # as teacher_forced's, over the prompt
        inputs = dict(input_ids=ids[first], attention_mask=mask[first], position_ids=positions[first])
        return PromptPart(self.decoder, inputs, torch.arange(len(first), device=ids.device), [])

    def tangents(self, directions: dict[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
        """The derivative of `outputs()` [U, ...] along `directions` (a tangent per parameter of the decoder,
        the others held fixed), by forward-mode AD: one forward of the distinct prompts. Attention runs in
        SDPA's math kernel, the one with forward-mode derivatives on every device."""
        from torch.func import jvp
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names: dict[torch.Tensor, str] = {p: n for n, p in self.decoder.named_parameters()}
        params = list(directions)

        def along(*weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return tuple(self.outputs({names[p]: w for p, w in zip(params, weights)}))

        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            done = jvp(along, tuple(p.detach() for p in params), tuple(directions[p].to(p.dtype) for p in params))
        return list(done[1])

    def merged(self, parts: list[PromptPart], grads: list[list[torch.Tensor | None]]
               ) -> tuple[PromptPart, list[torch.Tensor | None]]:
        """`parts` as one: their prompts left-padded to the longest and stacked (pads are masked and take
        position 0, as in a micro-batch), their rows in order; `grads` (per part, per leaf [n, ...]) laid out
        for it, the keys' and values' zero-padded on the left likewise."""
        P = max(p.inputs["input_ids"].shape[1] for p in parts)

        def left(x: torch.Tensor, dim: int) -> torch.Tensor:
            pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [P - x.shape[dim], 0]
            return torch.nn.functional.pad(x, pad)

        inputs = {k: torch.cat([left(p.inputs[k], 1) for p in parts]) for k in parts[0].inputs}
        offsets = torch.tensor([0] + [len(p.inputs["input_ids"]) for p in parts[:-1]]).cumsum(0).tolist()
        inverse = torch.cat([p.inverse + off for p, off in zip(parts, offsets)])
        merged: list[torch.Tensor | None] = []
        for j in range(len(grads[0])):  # leaf j: a layer's keys or values [n, h, P, d]; the last, the hidden [n, 1, H]
            per = [g[j] for g in grads]
            if all(x is None for x in per):
                merged.append(None)
                continue
            like = next(x for x in per if x is not None)
            is_kv = j < len(grads[0]) - 1
            shape = [*like.shape[1:-2], P, like.shape[-1]] if is_kv else list(like.shape[1:])
            merged.append(torch.cat([torch.zeros(len(p.inverse), *shape, dtype=like.dtype, device=like.device)
                                     if x is None else left(x, -2) if is_kv else x for x, p in zip(per, parts)]))
        return PromptPart(self.decoder, inputs, inverse, []), merged


def keys_values(cache: DynamicCache) -> list[torch.Tensor]:
    """Every layer's keys and values of a cache of full-attention layers, in order."""
    out = []
    for layer in cache.layers:
        kv = cast(DynamicLayer, layer)
        assert kv.keys is not None and kv.values is not None, "a layer the forward did not fill"
        out += [kv.keys, kv.values]
    return out


@dataclass
class PromptTape:
    """The shared forwards run inside `taped_prompts()`, in order."""

    parts: list[PromptPart] = field(default_factory=list)


_TAPE: ContextVar[PromptTape | None] = ContextVar("prompt_tape", default=None)


@contextmanager
def taped_prompts() -> Iterator[PromptTape]:
    """Shared prompts run without a graph, each row from its own leaves (module docstring)."""
    tape = PromptTape()
    token = _TAPE.set(tape)
    try:
        yield tape
    finally:
        _TAPE.reset(token)


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
    inputs = dict(input_ids=prompt_ids[f], attention_mask=prompt_mask[f], position_ids=positions[f, :P])
    tape = _TAPE.get()
    with torch.no_grad() if tape is not None else contextlib.nullcontext():
        prompt: torch.Tensor = decoder(**inputs, cache=cache, use_cache=True).last_hidden_state  # [U, P, H]
    first_token = prompt[groups.inverse, -1:]  # [N, 1, H]: the prompt's last position predicts token 0
    if tape is not None:  # each row from leaves of its own (the module docstring)
        first_token.requires_grad_()
        for layer in cache.layers:
            kv = cast(DynamicLayer, layer)
            assert kv.keys is not None and kv.values is not None
            kv.keys, kv.values = kv.keys[groups.inverse].requires_grad_(), kv.values[groups.inverse].requires_grad_()
        tape.parts.append(PromptPart(decoder, inputs, groups.inverse, [*keys_values(cache), first_token]))
    elif t > 1:
        cache.batch_select_indices(groups.inverse)  # each row's copy of its prompt's keys and values [N, ...]
    if t == 1:
        return first_token
    rest: torch.Tensor = decoder(input_ids=completion_ids[:, :-1], attention_mask=attn[:, :-1], position_ids=positions[:, P:-1],
                   cache=cache, use_cache=True).last_hidden_state  # [N, t-1, H]: token j predicts token j+1
    return torch.cat([first_token, rest], dim=1)
