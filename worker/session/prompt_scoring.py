"""What a sample request asks of its prompt, answered from one forward pass over it: each prompt
token's log-prob, the top-k at each position, the log-probs of named token ids, and alternative tokens
drawn at each position (service.core.tinker.sampling says what each is on the wire).

Only the positions some answer needs are turned into log-probs (`logits_to_keep`): scoring the last n
tokens of a long prompt costs the forward pass, not a [P, V] softmax.
"""

from __future__ import annotations

import numpy as np
import torch

from service.core.tinker.sampling import MASK_LOGPROB, PromptAsk, PromptScores, TopK
from worker.session.token_sampler import generator


@torch.no_grad()
def score_prompt(model: torch.nn.Module, prompt: list[int], ask: PromptAsk) -> PromptScores:
    """Every answer `ask` names, for a prompt of P >= 2 tokens. Log-probs are the model's own
    (temperature 1); the alternative draws and their log-probs are at the request's temperature."""
    device = next(model.parameters()).device
    P = len(prompt)
    scored_from = 1 if ask.last_n is None else P - ask.last_n  # the first position logprobs and topk score
    needs = [scored_from] if ask.logprobs or ask.topk else []
    if ask.targets is not None:
        needs.append(1 + ask.targets.first_row)
    if ask.alt_k:
        needs.append(1)
    first = min(needs)  # the first position any answer needs
    ids = torch.tensor([prompt], device=device)  # [1, P]
    logits = model(input_ids=ids, logits_to_keep=P - first + 1).logits[0, :-1].float()  # [P-first, V]
    logp = torch.log_softmax(logits, -1)  # row j: the distribution of position first + j
    V = logp.shape[-1]

    def at(start: int) -> torch.Tensor:  # the rows of positions start..P-1
        return logp[start - first:]

    scores: dict = {}
    if ask.logprobs:
        lp = np.full(P, np.nan, dtype=np.float32)
        lp[scored_from:] = at(scored_from).gather(-1, ids[0, scored_from:, None])[:, 0].cpu().numpy()
        scores["logprobs"] = lp
    if ask.topk:
        k = min(ask.topk, V)
        top = torch.topk(at(scored_from), k, dim=-1)  # [P-scored_from, k]
        top_ids = np.zeros((P, k), dtype=np.int32)
        top_lps = np.full((P, k), MASK_LOGPROB, dtype=np.float32)
        top_ids[scored_from:], top_lps[scored_from:] = top.indices.cpu().numpy(), top.values.cpu().numpy()
        scores["topk"] = TopK(top_ids, top_lps)
    if ask.targets is not None:
        asked = torch.from_numpy(ask.targets.ids).to(device)  # [P-1, K]; row i: position i + 1
        rows = asked[first - 1:]  # the rows from position `first` on (those before name nothing)
        picked = at(first).gather(-1, rows.clamp(min=0)).masked_fill(rows < 0, 0.0)  # [P-first, K]
        targets = np.zeros(asked.shape, dtype=np.float32)
        targets[first - 1:] = picked.cpu().numpy()
        scores["targets"] = targets
    if ask.alt_k:
        scores["alt_ids"], scores["alt_logprobs"] = _draws(at(1), ask, device)
    return PromptScores(**scores)


def _draws(logp: torch.Tensor, ask: PromptAsk, device: torch.device) -> tuple[np.ndarray, np.ndarray]:
    """`ask.alt_k` tokens per position of logp [L, V], drawn with replacement at the request's
    temperature from the request's own seed, and their log-probs under that distribution: [L, k] each."""
    if logp.shape[0] == 0:  # a one-token prompt: no position after the first
        return np.zeros((0, ask.alt_k), np.int64), np.zeros((0, ask.alt_k), np.float32)
    if ask.temperature == 0:  # greedy, as a greedy sample is: the argmax, scored at temperature 1
        drawn = logp.argmax(-1, keepdim=True).expand(-1, ask.alt_k)  # [L, k]
        scaled = logp
    else:
        gen = generator(ask.seed, device)
        scaled = torch.log_softmax(logp / ask.temperature, -1)  # log_softmax(logits / T): logp is logits shifted
        drawn = torch.multinomial(scaled.exp(), ask.alt_k, replacement=True, generator=gen)  # [L, k]
    return drawn.cpu().numpy().astype(np.int64), scaled.gather(-1, drawn).cpu().numpy().astype(np.float32)
