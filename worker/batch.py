"""The rollout batch every room reads, and what a loop asks of a sampler.

`RolloutBatch` is a step's sampled rows: prompts left-padded, completions right-padded, with the masks,
the decoded texts and (from vLLM) the sampler's own log-probs and weight versions. `RolloutEngine` is the
protocol every sampler implements (worker/engines/: `HFEngine`, `VLLMEngine`); the loops see only it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P]
    completion_ids: torch.Tensor  # [N, T] right-padded
    completion_mask: torch.Tensor  # [N, T] 1 for tokens up to and including EOS / the stop string
    truncated: torch.Tensor  # [N] bool: hit max_new_tokens without EOS or stop string
    completions: list[str]  # decoded completions, cut after the stop string
    sampler_logp: torch.Tensor | None = None  # [N, T] the inference engine's log-probs of its samples (vllm)
    version: torch.Tensor | None = None  # [N] the weight version (sync count) that sampled each row (vllm)
    trained_mask: torch.Tensor | None = None  # [N, T] 1 on the model's own tokens, 0 on an environment's (episodes)

    def loss_mask(self) -> torch.Tensor:
        """[N, T] the tokens a loss may count: the completion's, less an environment's."""
        return self.completion_mask if self.trained_mask is None else self.completion_mask * self.trained_mask

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @staticmethod
    def empty(device: torch.device | str = "cpu", *, sampled: bool = False) -> RolloutBatch:
        """No rows (a step with no prompts); `sampled`: with the engine's log-probs and versions, as a
        vLLM engine's batches have them."""
        ids = torch.zeros(0, 0, dtype=torch.long, device=device)
        return RolloutBatch(prompt_ids=ids, prompt_mask=ids, completion_ids=ids, completion_mask=ids,
                            truncated=torch.zeros(0, dtype=torch.bool, device=device), completions=[],
                            sampler_logp=torch.zeros(0, 0, device=device) if sampled else None,
                            version=torch.zeros(0, dtype=torch.long, device=device) if sampled else None)

    def select(self, idx: torch.Tensor | list[int]) -> RolloutBatch:
        idx = torch.as_tensor(idx, dtype=torch.long)
        return RolloutBatch(prompt_ids=self.prompt_ids[idx], prompt_mask=self.prompt_mask[idx],
                            completion_ids=self.completion_ids[idx], completion_mask=self.completion_mask[idx],
                            truncated=self.truncated[idx], completions=[self.completions[i] for i in idx.tolist()],
                            sampler_logp=None if self.sampler_logp is None else self.sampler_logp[idx],
                            version=None if self.version is None else self.version[idx],
                            trained_mask=None if self.trained_mask is None else self.trained_mask[idx])

    def trimmed(self) -> RolloutBatch:
        """The same rows without the columns that are padding in every row (prompts' left, completions' right)."""
        p = int(self.prompt_mask.sum(1).max()) if len(self) else 0
        t = int(self.completion_mask.sum(1).max()) if len(self) else 0
        P = self.prompt_ids.shape[1]
        return RolloutBatch(prompt_ids=self.prompt_ids[:, P - p:], prompt_mask=self.prompt_mask[:, P - p:],
                            completion_ids=self.completion_ids[:, :t], completion_mask=self.completion_mask[:, :t],
                            truncated=self.truncated, completions=self.completions,
                            sampler_logp=None if self.sampler_logp is None else self.sampler_logp[:, :t],
                            version=self.version,
                            trained_mask=None if self.trained_mask is None else self.trained_mask[:, :t])

    def to(self, device: torch.device | str) -> RolloutBatch:
        return RolloutBatch(prompt_ids=self.prompt_ids.to(device), prompt_mask=self.prompt_mask.to(device),
                            completion_ids=self.completion_ids.to(device),
                            completion_mask=self.completion_mask.to(device), truncated=self.truncated.to(device),
                            completions=self.completions,
                            sampler_logp=None if self.sampler_logp is None else self.sampler_logp.to(device),
                            version=None if self.version is None else self.version.to(device),
                            trained_mask=None if self.trained_mask is None else self.trained_mask.to(device))

    @staticmethod
    def cat(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
        P = max(b.prompt_ids.shape[1] for b in batches)
        T = max(b.completion_ids.shape[1] for b in batches)

        def lpad(x: torch.Tensor, w: int, v: float) -> torch.Tensor:
            return torch.nn.functional.pad(x, (w - x.shape[1], 0), value=v)

        def rpad(x: torch.Tensor, w: int, v: float) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, w - x.shape[1]), value=v)

        return RolloutBatch(
            prompt_ids=torch.cat([lpad(b.prompt_ids, P, pad_id) for b in batches]),
            prompt_mask=torch.cat([lpad(b.prompt_mask, P, 0) for b in batches]),
            completion_ids=torch.cat([rpad(b.completion_ids, T, pad_id) for b in batches]),
            completion_mask=torch.cat([rpad(b.completion_mask, T, 0) for b in batches]),
            truncated=torch.cat([b.truncated for b in batches]),
            completions=[c for b in batches for c in b.completions],
            sampler_logp=None if any(b.sampler_logp is None for b in batches) else
            torch.cat([rpad(b.sampler_logp, T, 0.0) for b in batches if b.sampler_logp is not None]),
            version=None if any(b.version is None for b in batches) else
            torch.cat([b.version for b in batches if b.version is not None]),
            trained_mask=None if all(b.trained_mask is None for b in batches) else
            torch.cat([rpad(b.loss_mask(), T, 0) for b in batches]),
        )


Prompts = list[str] | list[list[int]]  # texts to tokenize, or token ids to sample from as they are


def left_padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and mask [N, L] of token rows, left-padded to the longest (L: 0 for none)."""
    L = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, L - len(r):], mask[i, L - len(r):] = torch.tensor(r, dtype=torch.long), 1
    return ids, mask


def encode_prompts(tokenizer: Any, prompts: Prompts, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask [P, L] of `prompts`: texts tokenized (no special tokens added), ids kept."""
    if prompts and not isinstance(prompts[0], str):
        ids, mask = left_padded(prompts, tokenizer.pad_token_id)
        return ids.to(device), mask.to(device)
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


class RolloutEngine(Protocol):
    """What a loop asks of whatever samples its rollouts: `HFEngine` (generate on a frozen copy, in
    this process) or `worker.engines.vllm_engine.VLLMEngine` (a vLLM server of the job's own)."""

    params: SamplingParams
    version: int  # weight syncs so far: a batch sampled by an earlier version is that many steps stale

    def sync(self, policy: torch.nn.Module) -> None:
        """Take the policy's current weights: what the next rows are sampled with."""

    def generate(self, prompts: Prompts, num_generations: int, *, seeds: list[int] | None = None,
                 greedy: bool = False) -> RolloutBatch:
        """`num_generations` completions per prompt, prompt-major [P*G]; sampling takes one seed per prompt.
        Prompts given as ids are sampled from exactly those ids (an episode's turns)."""

    def submit(self, prompts: Prompts, num_generations: int, *, seeds: list[int] | None = None,
               greedy: bool = False) -> Callable[[], RolloutBatch]:
        """`generate`, started now; the call returned gives its batch (a vLLM server samples meanwhile)."""

    def rest(self) -> None:
        """The step's rollouts are done and the trainer trains: memory the engine can give back for a while
        (a vLLM server's sleep on the trainer's GPU), until the next `sync`."""

    def logprobs(self, batch: RolloutBatch, micro_batch_size: int,
                 micro_batch_tokens: int | None = None) -> torch.Tensor:
        """[N, T] log-probs of the batch's completions under the weights synced last."""
