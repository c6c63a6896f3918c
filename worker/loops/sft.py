"""Supervised fine-tuning (`kind: sft`): cross-entropy on the answer tokens of {prompt, answer} rows.

Per step:
  1. the next `sft.batch_size` examples of the train split, in an order shuffled once per pass over
     it (seeded by `sft.seed` and the pass, so a resumed job sees the order a straight one does);
     with several processes each takes its share;
  2. each row is the job's prompt (the dataset's instruction, the chat template) followed by its
     first answer and EOS, the answer cut at `sft.max_new_tokens` tokens;
  3. micro-batched forward and backward of the answer tokens' summed negative log-likelihood,
     divided by the answer tokens of the whole batch (every process's), so the update is the token
     mean's gradient whatever the micro-batching;
  4. gradient clipping and one AdamW step.
Evaluation (at step 0, every `sft.eval_every` steps and at the end): greedy answers to the
validation prompts scored by the dataset's accuracy check and the job's rewards (`eval/accuracy`,
`eval/reward_mean`), and on `sft.val_batches` batches of the validation split the answer tokens'
cross-entropy `loss/val` and the share the model ranks first, `eval/token_accuracy`.

Run it:  grpo-jobs run examples/sft-arith.yaml --out runs/sft
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from service.core import tracing
from service.core.settings import Settings
from service.core.specs import SFTJob
from worker.batch import RolloutBatch
from worker.datasets import Example
from worker.environments import episodes as episode_rows
from worker.loops import evaluation, skeleton, update, utilisation
from worker.loops.setup import Setup, build
from worker.loops.sources import prompt_for
from worker.model.forward import forward_inputs, sequence_logprobs
from worker.parallel.distributed import SINGLE, Ranks
from worker.reporting import LoopResult, Reporter
from worker.training import NonFiniteUpdate, eval_mode, seed_everything


def step_examples(s: Setup[SFTJob], step: int) -> list[Example]:
    """This process's share of step `step`'s batch: examples (step-1)*B .. step*B - 1 of the train
    split's passes, each pass in its own seeded order."""
    train, B = s.task.train, s.spec.sft.batch_size
    orders: dict[int, torch.Tensor] = {}  # pass -> its order of the train split
    out = []
    for i in range((step - 1) * B, step * B):
        n_pass, at = divmod(i, len(train))
        if n_pass not in orders:
            orders[n_pass] = torch.randperm(len(train), generator=torch.Generator().manual_seed(
                s.spec.sft.seed * 100_003 + n_pass))
        out.append(train[int(orders[n_pass][at])])
    return [out[i] for i in s.ranks.share(B)]


def encode(s: Setup[SFTJob], examples: list[Example]) -> RolloutBatch:
    """Prompt (left-padded) and answer + EOS (right-padded, cut at max_new_tokens) token ids of each
    example; `truncated` marks the answers that were cut. A demonstration (`env-demos`) is its episode's
    rows as played: its loss mask holds the model's turns, not the environment's."""
    tok, t = s.tokenizer, s.spec.sft
    if examples and all("episode" in ex.meta for ex in examples):
        return episode_rows.rows([ex.meta["episode"] for ex in examples], tok.pad_token_id)
    prompts = [tok(prompt_for(s, ex), add_special_tokens=False)["input_ids"] for ex in examples]
    answers = [tok(ex.answers[0], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for ex in examples]
    truncated = torch.tensor([len(a) > t.max_new_tokens for a in answers])
    answers = [a[: t.max_new_tokens] for a in answers]
    P, T, n = max(map(len, prompts)), max(map(len, answers)), len(examples)
    prompt_ids = torch.full((n, P), tok.pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(n, P, dtype=torch.long)
    completion_ids = torch.full((n, T), tok.pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros(n, T, dtype=torch.long)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        prompt_ids[i, P - len(p):], prompt_mask[i, P - len(p):] = torch.tensor(p), 1
        completion_ids[i, :len(a)], completion_mask[i, :len(a)] = torch.tensor(a), 1
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                        completion_mask=completion_mask, truncated=truncated,
                        completions=[ex.answers[0] for ex in examples])


@tracing.traced("rl.train")
def train_step(run: skeleton.Run, batch: RolloutBatch) -> dict[str, float]:
    """3-4: the token-mean cross-entropy of the whole batch, accumulated over micro-batches; one step."""
    s = run.s
    tokens = s.ranks.sum({"tokens": float(batch.loss_mask().sum())})["tokens"]  # every process's answer tokens
    s.model.train()
    s.optimizer.zero_grad(set_to_none=True)
    nll = 0.0
    for idx in update.micro(s, batch, list(range(len(batch)))):
        mb = batch.select(idx).to(s.device)
        logp, _ = sequence_logprobs(s.model, mb, 1.0)  # [n, T], 0 at padding
        loss = -(logp * mb.loss_mask()).sum() / max(tokens, 1.0)
        if not torch.isfinite(loss):
            raise NonFiniteUpdate(f"the loss is {loss.item()}", step=run.step, hint="lower sft.learning_rate")
        loss.backward()
        nll += float(loss.detach())
    grad_norm = update.optimizer_step(run)
    totals = s.ranks.sum({"loss": nll, "truncated": float(batch.truncated.sum()), "rows": float(len(batch))})
    return {"loss/train": totals["loss"], "grad_norm": grad_norm, "lr": float(s.scheduler.get_last_lr()[0]),
            "sft/answer_tokens": tokens, "sft/truncated_ratio": totals["truncated"] / max(totals["rows"], 1.0)}


@dataclass(frozen=True)
class AnswerStats:
    """The answer tokens' summed negative log-likelihood, and how many the model ranks first."""

    nll: float
    hits: float
    tokens: float


@torch.no_grad()
def answer_stats(s: Setup[SFTJob], batch: RolloutBatch) -> AnswerStats:
    """Teacher-forced over `batch`, without dropout: one forward per micro-batch, the logits of the
    answer positions only."""
    nll = hits = 0.0
    with eval_mode(s.model):
        for idx in update.micro(s, batch, list(range(len(batch)))):
            b = batch.select(idx).trimmed().to(s.device)
            t = b.completion_ids.shape[1]
            # [n, t, V]: the position before answer token j predicts it
            logits = s.model(**forward_inputs(b), logits_to_keep=t + 1).logits[:, -(t + 1):-1].float()
            real = b.loss_mask().bool()
            nll += float(torch.nn.functional.cross_entropy(logits[real], b.completion_ids[real], reduction="sum"))
            hits += float((logits.argmax(-1) == b.completion_ids)[real].sum())
    sums = s.ranks.sum({"nll": nll, "hits": hits, "tokens": float(batch.loss_mask().sum())})
    return AnswerStats(sums["nll"], sums["hits"], sums["tokens"])


def evaluate(s: Setup[SFTJob], step: int) -> dict[str, float]:
    """Greedy accuracy and rewards on the validation prompts, and loss/val, eval/token_accuracy."""
    out = evaluation.evaluate(s, step)
    t = s.spec.sft
    if t.val_batches:
        examples = evaluation.shard(s, s.task.val[: t.val_batches * t.batch_size])
        st = answer_stats(s, encode(s, examples))
        out.update({"loss/val": st.nll / max(st.tokens, 1.0), "eval/token_accuracy": st.hits / max(st.tokens, 1.0)})
    return out


def run(spec: SFTJob, reporter: Reporter, *, settings: Settings, ranks: Ranks = SINGLE) -> LoopResult:
    seed_everything(spec.sft.seed)
    s = build(spec, settings, reporter, ranks=ranks)
    run = skeleton.start(s, reporter, partial(evaluate, s))
    for step in run.steps():
        if stopped := skeleton.stop_requested(run, step):
            return stopped
        timer = skeleton.begin_step(run, step)
        batch = encode(s, step_examples(s, step))  # 1-2
        skeleton.rollouts_done(run, timer)
        metrics = train_step(run, batch)  # 3-4
        timer.train_s = timer.elapsed() - timer.rollout_s
        metrics.update(utilisation.sft_step(s, batch, train_s=timer.train_s))  # mfu/train
        skeleton.finish_step(run, step, metrics, timer=timer, tokens=float(batch.completion_mask.sum()))
    return skeleton.finish(run)
