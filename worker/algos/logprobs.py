"""Token log-probs through the LM head without the full-vocabulary logits.

A policy-gradient loss needs log pi(token) of the sampled tokens only, yet `model(...).logits`
materialises [rows, T, V] (V = 49,152 for SmolLM2: 0.8 GB in fp32 for 16 x 257 positions, and
several copies through the cast, the temperature and logsumexp), and autograd keeps it for
backward. Here the head runs over a few hundred positions at a time: the forward keeps one
logsumexp per position, and the backward recomputes each chunk's logits to form its gradient
(softmax - onehot), so no [positions, V] tensor outlives its chunk. The cost is one more pass of
the head's matmul in backward. The same idea as Liger's fused linear cross-entropy and TRL's
per-row selective log-softmax.

Pure torch. Values equal `log_softmax((h @ W.T + b) / temperature)[target]` to float rounding:
the head runs in the weights' dtype (or `head_dtype`, see `Float32Head`) and the softmax in at least
float32, as in `model(...).logits`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from worker.algos.losses import entropy_from_logits

# Logits held at once per chunk: 64 MiB of float32 (341 positions at V = 49,152).
CHUNK_BYTES = 64 * 2**20


def chunk_positions(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Positions per chunk so that one chunk's float32 logits stay within `chunk_bytes`."""
    return max(1, chunk_bytes // (4 * vocab))


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """[C, H] -> [C, V] in at least float32, divided by the temperature. The matmul runs in `weight`'s dtype."""
    z = torch.nn.functional.linear(h.to(weight.dtype), weight, bias)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return z / temperature if temperature != 1.0 else z


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                temperature: float, chunk: int, with_entropy: bool, head_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # hidden [M, H], weight [V, H], bias [V] | None, targets [M] long
        M = hidden.shape[0]
        w, b = _in_dtype(weight, bias, head_dtype)  # one cast a call, not one a chunk
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        logp = torch.empty(M, dtype=dtype, device=hidden.device)  # [M]
        lse = torch.empty(M, dtype=dtype, device=hidden.device)  # [M]
        ent = torch.empty(M, dtype=dtype, device=hidden.device) if with_entropy else None  # [M]
        for i in range(0, M, chunk):
            z = _logits(hidden[i:i + chunk], w, b, temperature)  # [C, V]
            lse[i:i + chunk] = torch.logsumexp(z, dim=-1)
            logp[i:i + chunk] = z.gather(1, targets[i:i + chunk, None]).squeeze(1) - lse[i:i + chunk]
            if ent is not None:
                ent[i:i + chunk] = entropy_from_logits(z)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk, ctx.head_dtype = temperature, chunk, head_dtype
        if ent is None:
            ent = torch.zeros(0, dtype=dtype, device=hidden.device)
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor, _grad_ent: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        w, b = _in_dtype(weight, bias, ctx.head_dtype)
        grad_h = torch.empty_like(hidden) if need_h else torch.empty(0)
        # Summed over chunks in float32 at least, cast once at the end.
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else torch.empty(0)
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else torch.empty(0)
        for i in range(0, hidden.shape[0], chunk):
            h = hidden[i:i + chunk]  # [C, H]
            g = grad_logp[i:i + chunk]  # [C]
            z = _logits(h, w, b, t)  # [C, V]
            # d logp / d z = onehot(target) - softmax(z); times the incoming gradient, over t
            dz = torch.exp(z - lse[i:i + chunk, None]).mul_(-g[:, None])
            dz.scatter_add_(1, targets[i:i + chunk, None], g[:, None].to(dz.dtype))
            if t != 1.0:
                dz.div_(t)
            if need_h:
                grad_h[i:i + chunk] = (dz.to(w.dtype) @ w).to(hidden.dtype)
            if need_w:
                grad_w += dz.T.to(acc) @ h.to(acc)
            if need_b:
                grad_b += dz.sum(0).to(acc)
        return (grad_h if need_h else None, grad_w.to(weight.dtype) if need_w else None,
                grad_b.to(bias.dtype) if need_b else None, None, None, None, None, None)


def _in_dtype(weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, *,
    temperature: float = 1.0, with_entropy: bool = False, chunk: int | None = None,
    head_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax((hidden @ weight.T + bias) / temperature)[targets], one chunk of positions at a time.

    hidden: [M, H] final hidden states (after the last norm), one per predicted token;
    weight: [V, H] the LM head (tied embeddings included); bias: [V] or None; targets: [M] token ids.
    Returns logp [M] (differentiable in hidden, weight and bias) and, if asked, the entropy [M] of
    each position's distribution (no gradient). `chunk`: positions per chunk (default: 64 MiB of logits).
    `head_dtype`: the dtype the head's matmul runs in (default: the weight's); gradients come back in
    the inputs' dtypes.
    """
    chunk = chunk or chunk_positions(weight.shape[0])
    head_dtype = head_dtype or weight.dtype
    # Function.apply is untyped in torch; forward() above says what it returns
    logp, ent = _TokenLogprobs.apply(hidden, weight, bias, targets, temperature, chunk, with_entropy,
                                    head_dtype)  # type: ignore[no-untyped-call]
    return logp, ent if with_entropy else None


class Float32Head(torch.nn.Linear):
    """An LM head whose matmul runs in float32 over low-precision weights and hidden states.

    A bfloat16 logit of magnitude 20 is rounded to a multiple of 0.125: the head alone moves a token's
    log-prob by up to a tenth of a nat, on the sampler's side and the trainer's differently. This head
    keeps the weights it is given (the same Parameter objects, so a head tied to the embeddings stays
    tied and checkpoints keep their keys) and computes `hidden @ W.T + b` in float32. For `generate`,
    which calls it once a token, and any forward of a frozen head, the float32 copy of the weights is
    kept while they are unchanged (V x H x 4 bytes: 113 MB for SmolLM2, 545 MB for Qwen2.5-0.5B); the
    training path (`token_logprobs`) casts once a micro-batch instead, so gradients reach the weights."""

    compute_dtype = torch.float32
    _cast: tuple[tuple[tuple[int, int], ...], Tensor, Tensor | None] | None = None  # (each parameter's pointer
    # and version, W, b)

    @classmethod
    def wrap(cls, head: torch.nn.Linear) -> Float32Head:
        new = cls(head.in_features, head.out_features, bias=head.bias is not None, device="meta")
        new.weight, new.bias = head.weight, head.bias  # the same Parameters: ties and state-dict keys kept
        return new

    def forward(self, hidden: Tensor) -> Tensor:
        # hidden [..., H] -> logits [..., V] in float32
        trained = any(p.requires_grad for p in self.parameters())  # a frozen head (LoRA) reuses its cast
        if torch.is_grad_enabled() and trained:  # the gradient must reach the weights themselves
            w, b = _in_dtype(self.weight, self.bias, self.compute_dtype)
        else:
            key = tuple((p.data_ptr(), p._version) for p in self.parameters())  # an in-place update bumps a version
            if self._cast is None or self._cast[0] != key:
                self._cast = (key, *_in_dtype(self.weight, self.bias, self.compute_dtype))
            _, w, b = self._cast
        return torch.nn.functional.linear(hidden.to(w.dtype), w, b)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cast": None}  # a copy of the module (the rollout copy) casts its own
