"""Model FLOPs of the phases of a GRPO step, counted from a decoder's shapes.

Model FLOPs are the work the maths needs, not what an implementation happens to do: a prompt is
prefilled once for its group, in sampling and in a teacher-forced forward alike (however many times an
implementation recomputes it), padding costs nothing,
and recomputation for gradient checkpointing is not counted (the convention of the MFU figures
large-scale reports quote, after Chowdhery et al. 2022). A multiply-add is 2 FLOPs.

Per token, a decoder layer's projections cost 2 x their weights (q and o: hidden x q_dim; k and v:
hidden x kv_dim each; a gated MLP: 3 x hidden x intermediate), the head 2 x hidden x vocab where
logits are taken, and attention 4 x q_dim per key it attends to (scores and the weighted sum).
Backward costs as much as the forward again for the inputs' gradients, and once more for the weights'
gradients where the weights train: 2x the forward with frozen base weights (LoRA; the adapters'
own gradients are a rank-r sliver, left out), 3x with full fine-tuning.

Pure arithmetic on plain ints: no torch, no transformers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecoderShape:
    """What FLOPs depend on, from a model config."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    def linear_per_token(self) -> int:
        """2 x the projection weights one token goes through in all layers (no head)."""
        kv_dim = self.kv_heads * self.head_dim
        per_layer = 2 * self.hidden * self.q_dim + 2 * self.hidden * kv_dim + 3 * self.hidden * self.intermediate
        return 2 * self.layers * per_layer

    def head_per_token(self) -> int:
        return 2 * self.hidden * self.vocab

    def attention(self, queries: int, before: int) -> int:
        """`queries` consecutive positions, each attending causally to itself, the queries before it and
        `before` cached positions."""
        keys = queries * before + queries * (queries + 1) // 2
        return 4 * self.layers * self.q_dim * keys


def forward(shape: DecoderShape, prompt: int, completion: int) -> int:
    """One teacher-forced row: prompt + completion positions, logits for the completion's tokens."""
    n = prompt + completion
    return n * shape.linear_per_token() + shape.attention(n, 0) + completion * shape.head_per_token()


def group_forward(shape: DecoderShape, prompt: int, completions: list[int]) -> int:
    """Teacher-forced rows that share one prompt: the prompt's positions once, each completion attending
    to it (what `forward` counts for a group of one)."""
    return (prompt * shape.linear_per_token() + shape.attention(prompt, 0) +
            sum(c * (shape.linear_per_token() + shape.head_per_token()) + shape.attention(c, prompt) for c in completions))


def prefill(shape: DecoderShape, prompt: int) -> int:
    """A prompt's keys and values and its last position's logits (the first sampled token)."""
    return prompt * shape.linear_per_token() + shape.attention(prompt, 0) + shape.head_per_token()


def decode(shape: DecoderShape, prompt: int, completion: int) -> int:
    """The completion's tokens after the first, one position at a time against the cache."""
    steps = max(completion - 1, 0)  # the last sampled token is not fed back
    attn = sum(shape.attention(1, prompt + t) for t in range(steps))
    return steps * (shape.linear_per_token() + shape.head_per_token()) + attn


def sampling(shape: DecoderShape, prompts: list[int], groups: list[list[int]]) -> int:
    """Sampling groups[i] completions (their lengths) of prompts[i] (its length): each prompt once."""
    return sum(prefill(shape, p) + sum(decode(shape, p, c) for c in group) for p, group in zip(prompts, groups,
                                                                                               strict=True))


def sampling_bytes(shape: DecoderShape, prompts: list[int], groups: list[list[int]], *, weight_bytes: int,
                   value_bytes: int) -> int:
    """The bytes sampling groups[i] completions of prompts[i] must read from memory when every row decodes in
    one batch: the weights (`weight_bytes`) once for the prefill and once per decode position of the longest
    completion (the batch advances together), and each row's cached keys and values (`value_bytes` each)
    once per position it decodes. What model bandwidth utilisation (mbu/sampling) divides by the seconds."""
    kv_per_position = 2 * shape.layers * shape.kv_heads * shape.head_dim * value_bytes
    steps = max((max(group, default=0) for group in groups), default=0) - 1  # the last token is not fed back
    cache = sum(sum(p + t for t in range(max(c - 1, 0))) for p, group in zip(prompts, groups, strict=True)
                for c in group)
    return weight_bytes * (1 + max(steps, 0)) + kv_per_position * cache


def training(forward_flops: int, *, frozen_base: bool) -> int:
    """A forward and its backward (module docstring)."""
    return forward_flops * (2 if frozen_base else 3)
