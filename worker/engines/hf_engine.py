"""The in-process sampler: Hugging Face `generate` on a frozen copy of the policy.

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
from collections.abc import Callable
from typing import Any

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StaticCache,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.cache_utils import StaticLayer

from worker.algos.draws import inverse_cdf, uniforms
from worker.algos.lora import is_lora
from worker.batch import Prompts, RolloutBatch, SamplingParams, encode_prompts
from worker.engines.folded import FoldedSampler, foldable
from worker.model.forward import batch_logprobs, micro_batches
from worker.parallel.distributed import row_seed


class RowSampler(LogitsProcessor):
    """Samples each row's next token with the row's own generator and leaves only that token
    possible, so greedy decoding emits it. Temperature, top-k and top-p are transformers' own
    warpers, in the order transformers' sampling applies them."""

    def __init__(self, seeds: list[int], params: SamplingParams, device: torch.device) -> None:
        self.gens = [torch.Generator(device).manual_seed(s) for s in seeds]
        self.warpers: list[LogitsProcessor] = [TemperatureLogitsWarper(params.temperature)] if params.temperature != 1.0 else []
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


def completion_lengths(tokenizer: Any, rows: torch.Tensor, eos_ids: set[int],
                       stop: tuple[str, ...]) -> tuple[list[int], list[bool]]:
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


def eos_token_ids(tokenizer: Any, model: torch.nn.Module) -> set[int]:
    """Every id that ends a completion: the tokenizer's EOS and the model's generation config's."""
    config = getattr(model, "generation_config", None)
    gen_eos = getattr(config, "eos_token_id", None)
    ids = {tokenizer.eos_token_id} | (set(gen_eos) if isinstance(gen_eos, list) else {gen_eos})
    return {int(i) for i in ids if i is not None}


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
    config: Any = model.config
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
        assert isinstance(layer, StaticLayer) and layer.keys is not None and layer.values is not None
        rows.update(layer.keys.repeat_interleave(repeats, 0), layer.values.repeat_interleave(repeats, 0), i)
    return rows


class HFEngine:
    """Frozen copy of the policy used for sampling and old log-probs.

    `sharded`: the policy is sharded across processes (FSDP2) and is sampled from itself, with
    every process's forward in lockstep; old log-probs are taken before the step's first update,
    when its weights are the rollout weights, so no copy is needed."""

    def __init__(self, policy: torch.nn.Module, tokenizer: Any, device: str, params: SamplingParams, *,
                 sharded: bool = False, fold: bool = False) -> None:
        self.tokenizer, self.params, self.device, self.sharded = tokenizer, params, torch.device(device), sharded
        self.eos_ids = eos_token_ids(tokenizer, policy)
        self.version = 0
        self.folded: FoldedSampler | None = None
        if sharded:
            self.model = policy
            return
        same_device = next(policy.parameters()).device == self.device
        memo: dict[int, Any] = {}
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
        if "cache" not in kwargs and not self.sharded:
            # the static cache made here, in the dtype of the first keys written to it: generate() makes its own
            # in the weights' dtype, where float32 activations over bfloat16 weights (model.activations) write
            # float32 keys
            kwargs.pop("cache_implementation", None)
            config: Any = self.sampler.config  # a transformers model's, untyped on a Module
            kwargs["cache"] = StaticCache(config=config, max_cache_len=ids.shape[1] + sp.max_new_tokens)
        generate: Any = self.sampler.generate  # transformers' GenerationMixin, untyped on a Module
        out = generate(input_ids=ids, attention_mask=mask, **kwargs)
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
