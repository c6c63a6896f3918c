"""The retriever as a policy: sample k documents without replacement from softmax(score / tau)
over its candidates, and the PPO-clipped loss that trains it from the generator's rewards. Pure torch.

Sampling k without replacement from a softmax is the Plackett-Luce model: document j of the
ordered draw has probability exp(l[i_j]) / sum_{c not yet drawn} exp(l[c]). Adding Gumbel noise
to the logits and taking the top k draws exactly from it (Kool et al. 2019).
"""

from __future__ import annotations

import torch


def sample_without_replacement(logits: torch.Tensor, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Indices [k] of an ordered draw of k candidates without replacement from softmax(logits). logits: [C]."""
    u = torch.rand(logits.shape, generator=generator, dtype=torch.float64).clamp(min=1e-20)
    gumbel = -torch.log(-torch.log(u)).to(logits.device)
    return torch.topk(logits.detach().double() + gumbel, k).indices


def sequential_logprobs(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Log-probability of each pick of the ordered draw `idx` [k] under Plackett-Luce. logits: [C] -> [k].

    Their sum is the log-probability of the whole ordered draw.
    """
    k = idx.numel()
    C = logits.numel()
    taken = torch.zeros(k, C, dtype=torch.bool, device=logits.device)  # row j: drawn before pick j
    for j in range(1, k):
        taken[j] = taken[j - 1]
        taken[j, idx[j - 1]] = True
    masked = logits.unsqueeze(0).masked_fill(taken, float("-inf"))  # [k, C]
    return logits[idx] - torch.logsumexp(masked, dim=-1)  # [k]


def categorical_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(softmax(logits) || softmax(ref_logits)) over the candidates. [C], [C] -> scalar."""
    logp, ref = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    return (logp.exp() * (logp - ref)).sum(-1)


def categorical_entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


def retriever_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    logits: torch.Tensor | None = None,
    ref_logits: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clipped loss over one query's k sampled documents, plus kl_coef * KL to the reference.

    logp, old_logp, advantages: [k] (per-pick log-probs under the current and the sampling policy,
    and document advantages normalised within the k); logits, ref_logits: [C] over the candidates.
    """
    ratio = torch.exp(logp - old_logp)  # [k]
    surrogate = torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages)
    loss = -surrogate.mean()
    stats = {"retriever/ratio_mean": ratio.detach().mean()}
    if logits is not None and ref_logits is not None:  # measured only against a reference
        kl = categorical_kl(logits, ref_logits)
        loss = loss + kl_coef * kl
        stats["retriever/kl"] = kl.detach()
    return loss, {"retriever/loss": loss.detach(), **stats}
