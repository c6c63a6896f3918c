"""Sampling and per-token log-probs.

The rollout engine holds a frozen copy of the policy, synced at the start of every step (only the
adapter with LoRA), optionally on its own device. It samples with Hugging Face `generate` and
then recomputes log-probs from raw logits scaled by the sampler's temperature, never from the
processed scores generate returns (top-k/top-p would change them), so that the policy's
log-probs before its first update equal `old_logp` and the importance ratio is exactly 1.

Every sampled row draws from its own generator, seeded by the caller per prompt (`RowSampler`):
a row's completion depends on its seed and its prompt, not on the rest of the batch, so a step
split over several processes samples exactly what one process would.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StaticCache,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from worker.algos.draws import inverse_cdf, uniforms
from worker.algos.logprobs import Float32Head, token_logprobs
from worker.algos.lora import is_lora
from worker.algos.losses import entropy_from_logits
from worker.engines.folded import FoldedSampler, foldable
from worker.engines.prefix import completion_hidden, teacher_forced
from worker.parallel.distributed import row_seed


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

        def lpad(x, w, v):
            return torch.nn.functional.pad(x, (w - x.shape[1], 0), value=v)

        def rpad(x, w, v):
            return torch.nn.functional.pad(x, (0, w - x.shape[1]), value=v)

        return RolloutBatch(
            prompt_ids=torch.cat([lpad(b.prompt_ids, P, pad_id) for b in batches]),
            prompt_mask=torch.cat([lpad(b.prompt_mask, P, 0) for b in batches]),
            completion_ids=torch.cat([rpad(b.completion_ids, T, pad_id) for b in batches]),
            completion_mask=torch.cat([rpad(b.completion_mask, T, 0) for b in batches]),
            truncated=torch.cat([b.truncated for b in batches]),
            completions=[c for b in batches for c in b.completions],
            sampler_logp=None if any(b.sampler_logp is None for b in batches) else
            torch.cat([rpad(b.sampler_logp, T, 0.0) for b in batches]),
            version=None if any(b.version is None for b in batches) else torch.cat([b.version for b in batches]),
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


def encode_prompts(tokenizer, prompts: Prompts, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
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
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: the wrapped model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    if type(head) not in (torch.nn.Linear, Float32Head) or decoder is None or decoder is base:
        return None  # no head, or an adapter on the head itself
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
    `share_prompts`: rows with the same prompt share its forward (worker/engines/prefix.py).
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


def _logprobs_from_logits(model, b: RolloutBatch, kw: dict, temperature: float,
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


class RowSampler(LogitsProcessor):
    """Samples each row's next token with the row's own generator and leaves only that token
    possible, so greedy decoding emits it. Temperature, top-k and top-p are transformers' own
    warpers, in the order transformers' sampling applies them."""

    def __init__(self, seeds: list[int], params: SamplingParams, device: torch.device) -> None:
        self.gens = [torch.Generator(device).manual_seed(s) for s in seeds]
        self.warpers = [TemperatureLogitsWarper(params.temperature)] if params.temperature != 1.0 else []
        if params.top_k:
            self.warpers.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(params.top_p))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for w in self.warpers:
            scores = w(input_ids, scores)
        probs = torch.softmax(scores.float(), dim=-1)  # [B, V]
        picks = inverse_cdf(probs, uniforms(self.gens, probs.device))  # [B]
        only = torch.full_like(scores, float("-inf"))
        return only.scatter_(1, picks[:, None], 0.0)


def completion_lengths(tokenizer, rows: torch.Tensor, eos_ids: set[int], stop: tuple[str, ...]):
    """Per row: (number of tokens that count, ended_properly) from EOS or the first stop string."""
    lengths, ended = [], []
    for row in rows.tolist():
        n = next((i + 1 for i, t in enumerate(row) if t in eos_ids), None)
        if n is None and stop:
            text = tokenizer.decode(row, skip_special_tokens=True)
            if any(s in text for s in stop):
                lo, hi = 1, len(row)  # smallest prefix whose text contains a stop string
                while lo < hi:
                    mid = (lo + hi) // 2
                    if any(s in tokenizer.decode(row[:mid], skip_special_tokens=True) for s in stop):
                        hi = mid
                    else:
                        lo = mid + 1
                n = lo
        lengths.append(n if n is not None else len(row))
        ended.append(n is not None)
    return lengths, ended


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    ends = [text.index(s) + len(s) for s in stop if s in text]
    return text[: min(ends)] if ends else text


def eos_token_ids(tokenizer, model: torch.nn.Module) -> set[int]:
    """Every id that ends a completion: the tokenizer's EOS and the model's generation config's."""
    gen_eos = model.generation_config.eos_token_id if hasattr(model, "generation_config") else None
    ids = {tokenizer.eos_token_id} | (set(gen_eos) if isinstance(gen_eos, list) else {gen_eos})
    return ids - {None}


# The KV cache allocated once for the batch and the longest completion (a cache grown by
# concatenation copies itself at every token: 32 rows of a 961-token prompt generated 64 tokens in
# 122 s that way against 87 s), and the prompts' forward a bounded number of positions at a time
# (its attention scores and activations are [rows, chunk, ...]: peak 2.2 against 2.6 GB there).
# Never compiled: a job's shapes change every step.
PREFILL_CHUNK = 512
GENERATE_MEMORY = {"cache_implementation": "static", "disable_compile": True, "prefill_chunk_size": PREFILL_CHUNK}


def left_padded_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids [N, L] of left-padded rows from their mask, numbered as generate() numbers them."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


@torch.no_grad()
def shared_prompt_cache(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, repeats: int,
                        max_len: int) -> StaticCache | None:
    """The keys and values of each prompt but its last token, computed once per prompt and repeated for
    its `repeats` rows: a cache of P x repeats rows and `max_len` positions that generate() goes on from.

    The G completions of a prompt share it, so prefilling each row computes the same keys G times (on
    the demo, 32 rows of a 63-token prompt where 4 prompts need a quarter of the work). ids, mask: [P, L]
    left-padded. None where the model's cache is not plain full attention (sliding windows): those rows
    are prefilled one by one as before."""
    config = model.config
    once = StaticCache(config=config, max_cache_len=ids.shape[1] - 1)
    if any(type(layer).__name__ != "StaticLayer" for layer in once.layers):
        return None
    n = ids.shape[1] - 1  # the last token goes through generate(), which takes its logits
    positions = left_padded_positions(mask)
    for start in range(0, n, PREFILL_CHUNK):  # as generate() prefills: a bounded number of positions at a time
        end = min(n, start + PREFILL_CHUNK)
        model(input_ids=ids[:, start:end], attention_mask=mask[:, :end], position_ids=positions[:, start:end],
              cache=once, use_cache=True, logits_to_keep=1)
    rows = StaticCache(config=config, max_cache_len=max_len)
    for i, layer in enumerate(once.layers):
        rows.update(layer.keys.repeat_interleave(repeats, 0), layer.values.repeat_interleave(repeats, 0), i)
    return rows


class HFEngine:
    """Frozen copy of the policy used for sampling and old log-probs.

    `sharded`: the policy is sharded across processes (FSDP2) and is sampled from itself, with
    every process's forward in lockstep; old log-probs are taken before the step's first update,
    when its weights are the rollout weights, so no copy is needed."""

    def __init__(self, policy: torch.nn.Module, tokenizer, device: str, params: SamplingParams, *,
                 sharded: bool = False, fold: bool = False) -> None:
        self.tokenizer, self.params, self.device, self.sharded = tokenizer, params, torch.device(device), sharded
        self.eos_ids = eos_token_ids(tokenizer, policy)
        self.version = 0
        self.folded: FoldedSampler | None = None
        if sharded:
            self.model = policy
            return
        same_device = next(policy.parameters()).device == self.device
        memo = {}
        if is_lora(policy) and same_device:
            # Frozen base weights are identical and never change: share them, copy only the adapter.
            memo = {id(p): p for p in policy.parameters() if not p.requires_grad}
        self.model = copy.deepcopy(policy, memo).to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        layers = foldable(self.model) if fold else None
        if layers:
            self.folded = FoldedSampler(self.model, layers)

    @property
    def sampler(self) -> torch.nn.Module:
        """What `generate` decodes with: the folded copy where there is one (`fold`), else the rollout copy."""
        return self.folded.model if self.folded is not None else self.model

    def rest(self) -> None:
        """Nothing to give back: the frozen copy is the sampler, and with LoRA it shares the base weights."""

    @torch.no_grad()
    def sync(self, policy: torch.nn.Module) -> None:
        """Copy the trained weights in: with LoRA only the adapter (the base is frozen)."""
        self.version += 1
        src = dict(policy.named_parameters())
        for name, p in self.model.named_parameters():
            q = src[name]
            if q.requires_grad and p.data_ptr() != q.data_ptr():
                p.copy_(q.to(p.device))
        if self.folded is not None:
            self.folded.fold()

    @torch.no_grad()
    def generate(self, prompts: Prompts, num_generations: int, *, seeds: list[int] | None = None,
                 greedy: bool = False) -> RolloutBatch:
        """Sample num_generations completions per prompt, prompt-major: [P*G] rows. Sampling needs
        one seed per prompt; its G rows draw from generators seeded by (seed, g)."""
        tok, sp = self.tokenizer, self.params
        if not prompts:
            return RolloutBatch.empty(self.device)
        prompt_ids, prompt_mask = encode_prompts(tok, prompts, self.device)  # [P, Pw]
        ids = prompt_ids.repeat_interleave(num_generations, dim=0)  # [P*G, Pw]
        mask = prompt_mask.repeat_interleave(num_generations, dim=0)  # [P*G, Pw]
        kwargs = dict(max_new_tokens=sp.max_new_tokens, pad_token_id=tok.pad_token_id,
                      eos_token_id=sorted(self.eos_ids), **GENERATE_MEMORY)
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if not greedy:
            if seeds is None or len(seeds) != len(prompts):
                raise ValueError("sampling needs one seed per prompt")
            rows = [row_seed(s, g) for s in seeds for g in range(num_generations)]
            kwargs["logits_processor"] = LogitsProcessorList([RowSampler(rows, sp, self.device)])
        if sp.stop:
            kwargs.update(stop_strings=list(sp.stop), tokenizer=tok)
        if self.sharded:  # a process whose rows are done keeps taking part in the others' forwards
            kwargs["synced_gpus"] = True
        elif num_generations > 1 and ids.shape[1] > 1:
            cache = shared_prompt_cache(self.sampler, prompt_ids, prompt_mask, num_generations,
                                        ids.shape[1] + sp.max_new_tokens)
            if cache is not None:
                for k in ("cache_implementation", "prefill_chunk_size"):
                    kwargs.pop(k, None)
                kwargs["cache"] = cache
        out = self.sampler.generate(input_ids=ids, attention_mask=mask, **kwargs)
        completion = out[:, ids.shape[1]:]  # [N, T]
        lengths, ended = completion_lengths(tok, completion, self.eos_ids, sp.stop)
        T = completion.shape[1]
        cmask = (torch.arange(T, device=completion.device)[None, :] < torch.tensor(lengths, device=completion.device)[:, None]).long()
        truncated = ~torch.tensor(ended, device=completion.device)
        texts = [cut_at_stop(tok.decode(row[:n], skip_special_tokens=True), sp.stop)
                 for row, n in zip(completion.tolist(), lengths)]
        completion = torch.where(cmask.bool(), completion, torch.full_like(completion, tok.pad_token_id))
        batch = RolloutBatch(prompt_ids=ids, prompt_mask=mask, completion_ids=completion, completion_mask=cmask,
                             truncated=truncated, completions=texts)
        return batch

    def submit(self, prompts: Prompts, num_generations: int, *, seeds: list[int] | None = None,
               greedy: bool = False) -> Callable[[], RolloutBatch]:
        """`generate`, run now: sampling in the training process cannot run ahead of training."""
        batch = self.generate(prompts, num_generations, seeds=seeds, greedy=greedy)
        return lambda: batch

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch, micro_batch_size: int, micro_batch_tokens: int | None = None) -> torch.Tensor:
        """old_logp [N, T] under the rollout weights, in micro-batches."""
        micro = micro_batches(batch, list(range(len(batch))), max_rows=micro_batch_size, max_tokens=micro_batch_tokens)
        return batch_logprobs(self.model, batch, self.params.temperature, micro, self.device,
                              share_prompts=not self.sharded)
