"""Sampling token ids from token ids, as the tinker SDK's `sample` asks: n completions of one prompt,
each token's log-prob under the sampling distribution, the prompt's own log-probs, stop tokens and
stop strings. One batch of n rows shares the prompt, so there is no padding; a key-value cache
carries the prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Sampled:
    """One completion: its tokens, the log-prob of each under the sampling distribution (the logits
    scaled by the temperature, before top-k/top-p), and why it ended."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" (a stop token or string) | "length" (max_tokens)


@dataclass(frozen=True)
class Params:
    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1  # -1: off
    top_p: float = 1.0
    seed: int | None = None
    stop_tokens: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()


def _filter(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits [n, V] with what top-k and top-p exclude set to -inf."""
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the token that crosses top_p
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return scaled


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: list[int], n: int, p: Params,
           decode: Callable[[list[int]], str] | None = None) -> list[Sampled]:
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(p.seed if p.seed is not None else int(torch.seed() % 2**63))
    ids = torch.tensor([prompt] * n, device=device)  # [n, P]
    out = model(input_ids=ids, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1].float()  # [n, V]
    tokens: list[list[int]] = [[] for _ in range(n)]
    logps: list[list[float]] = [[] for _ in range(n)]
    reason = ["length"] * n
    live = [True] * n
    for _ in range(p.max_tokens):
        if p.temperature == 0:
            logp = torch.log_softmax(logits, -1)
            chosen = logits.argmax(-1, keepdim=True)  # [n, 1]
        else:
            scaled = logits / p.temperature
            logp = torch.log_softmax(scaled, -1)
            probs = torch.softmax(_filter(scaled, p.top_k, p.top_p), -1)
            chosen = torch.multinomial(probs, 1, generator=gen)  # [n, 1]
        chosen_logp = logp.gather(-1, chosen)[:, 0].tolist()
        for i, tok in enumerate(chosen[:, 0].tolist()):
            if not live[i]:
                continue
            tokens[i].append(tok)
            logps[i].append(chosen_logp[i])
            if tok in p.stop_tokens or (p.stop_strings and decode is not None
                                        and any(s in decode(tokens[i]) for s in p.stop_strings)):
                live[i], reason[i] = False, "stop"
        if not any(live):
            break
        out = model(input_ids=chosen, past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1].float()
    return [Sampled(tokens[i], logps[i], reason[i]) for i in range(n)]


@torch.no_grad()
def prompt_logprobs(model: torch.nn.Module, prompt: list[int]) -> np.ndarray:
    """[P] float32: the log-prob of each prompt token given the ones before it; NaN for the first,
    which has no context."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)  # [P-1, V]
    picked = logp.gather(-1, ids[0, 1:, None])[:, 0].cpu().numpy()
    return np.concatenate([[np.nan], picked]).astype(np.float32)
