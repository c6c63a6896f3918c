"""Joint retriever + generator GRPO (RAG): the retriever learns which documents make good answers.

Per step, for each of P training queries:
  1. the retriever (a dense dual encoder) scores its `retriever.candidates` best documents in the
     corpus index (re-encoded every `retriever.refresh_every` steps) and samples `retriever.k` of
     them without replacement from softmax(score / temperature), keeping their log-probs as old_logp
     (`generator_only: true` takes the top k instead and never trains the retriever);
  2. for each document the generator samples G answers to query + document: k * G generations per
     query, P * k * G per step;
  3. rewards score each answer; generator advantages are normalised within each document's G
     answers (GRPO-Clip per document group, KL to the frozen reference generator). With
     `grpo.drop_zero_std_groups`, a query whose k * G rewards all tie is replaced by a fresh one
     (up to `grpo.max_refill_rounds` rounds), and a document group whose G rewards tie is left out
     of the generator's loss;
  4. a document's reward is the mean of its G answers' rewards; retriever advantages are
     normalised within the query's k documents; the retriever loss is PPO-clipped over the
     documents' log-probs plus KL to a frozen reference retriever.
Total loss = generator loss (aggregated over every document group) + retriever loss; each has its
own AdamW (the retriever with `retriever.learning_rate`), stepped by the same clip-and-step and on
the same schedule (`grpo.lr_schedule`, `grpo.warmup_steps`).

Run it:  grpo-jobs run examples/joint-minimal.yaml --out runs/joint
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from functools import partial

import torch

from service.core.settings import Settings
from service.core.specs import JointJob
from worker import rewards
from worker.algos.advantages import group_advantages
from worker.algos.retrieval import (
    categorical_entropy,
    retriever_loss,
    sample_without_replacement,
    sequential_logprobs,
)
from worker.batch import RolloutBatch
from worker.datasets import Example, load_retrieval_task, rag_question, render_prompt
from worker.loops import evaluation, skeleton, update
from worker.loops.draws import Uniform, draw_share, pick
from worker.loops.rollouts import Draw, Drawn, Rollouts, Tied, collect_rollouts
from worker.loops.setup import Setup, build, policy_device
from worker.parallel.distributed import SINGLE, Ranks, row_seed
from worker.reporting import LoopResult, Reporter
from worker.retriever import DualEncoder, load_retriever
from worker.training import make_optimizer, make_scheduler, seed_everything


class Index:
    """Document embeddings of the whole corpus under the current document tower, encoded on first
    use (after a resume has restored the retriever) and again on every `refresh`."""

    def __init__(self, retriever: DualEncoder, corpus: list[tuple[str, str]], ranks: Ranks) -> None:
        self.retriever, self.ids, self.texts = retriever, [c[0] for c in corpus], [c[1] for c in corpus]
        self.ranks = ranks
        self.emb: torch.Tensor | None = None  # [D, h]

    @torch.no_grad()
    def refresh(self) -> None:
        """Each process encodes its share of the corpus; every one gets the whole index."""
        share = self.ranks.share(len(self.texts))
        self.emb = self.ranks.cat(self.retriever.documents([self.texts[i] for i in share]))  # [D, h]

    def candidates(self, q: torch.Tensor, n: int) -> torch.Tensor:
        """The n best documents for each query embedding. q: [P, h] -> [P, n]."""
        if self.emb is None:
            self.refresh()
        assert self.emb is not None
        return torch.topk(self.retriever.scores(q.detach(), self.emb), min(n, len(self.ids)), dim=-1).indices


@dataclass(frozen=True)
class Retrieval:
    """One query's draw of k documents from its candidate pool."""

    query: Example
    pool: torch.Tensor  # [C] corpus indices of the candidates
    logits: torch.Tensor  # [C] score / temperature, with grad
    picks: torch.Tensor  # [k] positions in the pool, in draw order
    ref_logits: torch.Tensor  # [C] under the frozen reference retriever
    old_logp: torch.Tensor  # [k] log-prob of each pick when it was drawn

    @property
    def documents(self) -> list[int]:
        """[k] corpus indices of the picks."""
        return self.pool[self.picks].tolist()


def retrieve(spec: JointJob, retriever: DualEncoder, ref: DualEncoder, index: Index, queries: list[Example],
             seeds: list[int], *, greedy: bool) -> list[Retrieval]:
    """Per query: candidate pool, logits over it (with grad), the k picks (drawn with the query's
    seed) and their old log-probs."""
    r = spec.retriever
    if not queries:
        return []
    q = retriever.queries([ex.question for ex in queries])  # [P, h]
    out = []
    for ex, q_i, pool, seed in zip(queries, q, index.candidates(q, r.candidates), seeds):
        texts = [index.texts[j] for j in pool.tolist()]
        logits = retriever.scores(q_i, retriever.documents(texts)) / r.temperature  # [C]
        picks = (torch.arange(r.k) if greedy else  # positions in pool
                 sample_without_replacement(logits, r.k, torch.Generator().manual_seed(seed)))
        with torch.no_grad():
            ref_logits = ref.scores(ref.queries([ex.question])[0], ref.documents(texts)) / r.temperature
        out.append(Retrieval(query=ex, pool=pool, logits=logits, picks=picks, ref_logits=ref_logits,
                             old_logp=sequential_logprobs(logits.detach(), picks)))
    return out


def rag_prompt(s: Setup[JointJob], question: str, document: str) -> str:
    return render_prompt(s.tokenizer, rag_question(question, document), s.task.instruction,
                         chat=s.spec.dataset.chat_template)


def draw_queries(s: Setup[JointJob], retriever: DualEncoder, ref: DualEncoder, index: Index, step: int) -> Draw[Retrieval]:
    """Units are training queries; each yields k groups, one per retrieved document. A query's
    draw of documents and its answers are seeded by (seed, step, round, query)."""
    spec, g, k = s.spec, s.spec.grpo, s.spec.retriever.k
    tag = f"queries-{g.seed}-{step}"
    rng, prompts = random.Random(tag), Uniform(len(s.task.train))

    def draw(round: int, n: int) -> Drawn[Retrieval]:
        share = draw_share(prompts, rng, n, s.ranks)
        queries, idx = pick(s.task.train, share), share.index
        picks = retrieve(spec, retriever, ref, index, queries, [row_seed(tag, round, i) for i in idx],
                         greedy=spec.retriever.generator_only)
        examples = [p.query for p in picks for _ in range(k)]
        texts = [rag_prompt(s, p.query.question, index.texts[j]) for p in picks for j in p.documents]
        seeds = [row_seed(tag, round, i, j) for i in idx for j in range(k)]
        batch = RolloutBatch.cat([s.engine.generate(texts[i:i + g.micro_batch_size], g.num_generations,
                                                    seeds=seeds[i:i + g.micro_batch_size])
                                  for i in range(0, max(len(texts), 1), g.micro_batch_size)], s.tokenizer.pad_token_id)
        return Drawn(batch=batch, examples=examples, prompts=texts, units=picks, keys=[(round, i) for i in idx],
                     groups_per_unit=k, picked=share.picked, drawn_by=prompts)

    return draw


def retriever_step(spec: JointJob, ro: Rollouts[Retrieval], optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler, retriever: DualEncoder,
                   index: Index) -> dict[str, float]:
    """Document rewards and advantages within each query's k; the PPO-clipped update when trained.
    The loss is the mean over every process's queries: each sums its own and divides by their count."""
    r, G, ranks = spec.retriever, ro.group_size, ro.ranks
    picks = ro.units
    doc_rewards = ro.rewards.view(len(picks), r.k, G).mean(-1)  # [P, k]
    doc_adv = group_advantages(doc_rewards.reshape(-1), r.k).view(len(picks), r.k)  # [P, k]
    gold = [p.query.meta.get("gold_doc_id") for p in picks]
    sums = ranks.sum({"P": len(picks), "reward": float(doc_rewards.sum()), "adv": float(doc_adv.abs().sum()),
                      "entropy": float(sum(categorical_entropy(p.logits.detach()) for p in picks)),
                      "no_gold": sum(gid is None for gid in gold),
                      "recall": sum(gid in {index.ids[j] for j in p.documents} for gid, p in zip(gold, picks))})
    P = sums["P"]
    stats = {"retriever/reward_mean": sums["reward"] / (P * r.k), "retriever/advantage_abs_mean": sums["adv"] / (P * r.k),
             "retriever/entropy": sums["entropy"] / P}
    if not sums["no_gold"]:
        stats["retriever/gold_recall"] = sums["recall"] / P
    if r.generator_only:
        return stats
    optimizer.zero_grad(set_to_none=True)
    loss, kl = torch.zeros(()), 0.0
    for p, a in zip(picks, doc_adv):
        loss_i, st = retriever_loss(sequential_logprobs(p.logits, p.picks), p.old_logp, a, clip_eps=r.clip_eps,
                                    logits=p.logits, ref_logits=p.ref_logits, kl_coef=r.kl_coef)
        loss = loss + loss_i / P
        kl += float(st["retriever/kl"])
    if loss.requires_grad:
        loss.backward()
    update.clip_and_step(list(retriever.parameters()), optimizer, scheduler, max_norm=spec.grpo.max_grad_norm,
                         ranks=ranks)
    t = ranks.sum({"loss": float(loss.detach()), "kl": kl})
    return {**stats, "retriever/loss": t["loss"], "retriever/kl": t["kl"] / P}


def document_of(ro: Rollouts[Retrieval], index: Index, group: int) -> dict[str, str | None]:
    """What a sample row records about the document its group answered from."""
    pick = ro.units[group // ro.groups_per_unit]
    return {"doc_id": index.ids[pick.documents[group % ro.groups_per_unit]],
            "gold_doc_id": pick.query.meta.get("gold_doc_id")}


@torch.no_grad()
def evaluate(s: Setup[JointJob], retriever: DualEncoder, index: Index, step: int) -> dict[str, float]:
    """Greedy: the top-1 document, then a greedy answer. Recall@1 where gold documents are known."""
    every = s.task.val[: s.spec.grpo.eval_prompts]
    val = evaluation.shard(s, every)
    top1 = index.candidates(retriever.queries([ex.question for ex in val]), 1)[:, 0].tolist() if val else []
    completions = evaluation.greedy_completions(s, [rag_prompt(s, ex.question, index.texts[j])
                                                    for ex, j in zip(val, top1)],
                                                filler=rag_prompt(s, every[0].question, index.texts[0]))
    found = [index.ids[j] == ex.meta.get("gold_doc_id") for ex, j in zip(val, top1) if "gold_doc_id" in ex.meta]
    out = evaluation.score_completions(s, completions, val, step=step, extra={
        "eval/token_f1": sum(rewards.token_f1(c, ex.answers) for c, ex in zip(completions, val)),
        "hits": sum(found), "with_gold": len(found)})
    hits, with_gold = out.pop("hits"), out.pop("with_gold")  # both as means over examples: their ratio is recall
    if with_gold:
        out["eval/retriever_recall_at_1"] = hits / with_gold
    return out


def run(spec: JointJob, reporter: Reporter, *, settings: Settings, ranks: Ranks = SINGLE) -> LoopResult:
    g, r = spec.grpo, spec.retriever
    seed_everything(g.seed)
    task, corpus = load_retrieval_task(spec.dataset, settings=settings, fetch=reporter.data_file)
    retriever = load_retriever(r, device=policy_device(spec, ranks), seed=g.seed, model_roots=settings.model_roots)
    ref = copy.deepcopy(retriever).eval().requires_grad_(False)  # frozen reference retriever
    # Dropout off, as in the policy: the retriever's log-probs at training time must be those it
    # sampled with (PPO's ratio), and every process must encode the corpus alike.
    retriever.eval().requires_grad_(not r.generator_only)
    ret_opt = make_optimizer(retriever.parameters(), lr=r.learning_rate, weight_decay=0.0, betas=g.betas)
    # the policy's schedule (grpo.lr_schedule, warmup_steps), one retriever step per training step
    ret_sched = make_scheduler(ret_opt, schedule=g.lr_schedule, warmup=g.warmup_steps, total=g.steps)
    trained = not r.generator_only
    s = build(spec, settings, reporter, task=task, extra={"retriever": retriever},
              extra_optimizers={"retriever": ret_opt} if trained else {},
              extra_schedulers={"retriever": ret_sched} if trained else {}, ranks=ranks)
    index = Index(retriever, corpus, ranks)
    reporter.event("corpus_indexed", f"{len(corpus)} documents; {r.k} x {g.num_generations} generations per query",
                   data={"documents": len(corpus), "generations_per_step": g.prompts_per_step * r.k * g.num_generations})
    run = skeleton.start(s, reporter, partial(evaluate, s, retriever, index))
    for step in run.steps():
        if stopped := skeleton.stop_requested(run, step):
            return stopped
        timer = skeleton.begin_step(run, step)  # seed, sync the rollout copy from the policy
        if (step - 1) % r.refresh_every == 0:
            index.refresh()

        # 1-3. retrieve k documents per query, G answers per document, advantages per document group
        ro = collect_rollouts(s, step, reporter, draw_queries(s, retriever, ref, index, step),
                              units=g.prompts_per_step, group_size=g.num_generations)
        skeleton.rollouts_done(run, timer)
        if isinstance(ro, Tied):
            skeleton.skip_step(run, step, "every query's answers tied", ro.metrics(), timer=timer)
            continue

        # 4. retriever: document rewards, advantages within the k, PPO-clipped loss + KL
        ret_stats = retriever_step(spec, ro, ret_opt, ret_sched, retriever, index)

        # generator: GRPO-Clip over every document group
        train_stats = update.train_epochs(run, ro, update.old_logprobs(s, ro), update.reference_logprobs(s, ro.batch),
                                          step)
        timer.train_s = timer.elapsed() - timer.rollout_s

        skeleton.finish_step(run, step, {**ro.metrics(), **train_stats, **ret_stats}, timer=timer,
                             tokens=float(ro.batch.completion_mask.sum()),
                             samples=ro.sample_rows(g.samples_per_step, extra=partial(document_of, ro, index)))
    return skeleton.finish(run)
