"""Joint retriever + generator GRPO (RAG): the retriever learns which documents make good answers.

Per step, for each of P training queries:
  1. the retriever (a dense dual encoder) scores its `retriever.candidates` best documents in the
     corpus index (re-encoded every `retriever.refresh_every` steps) and samples `retriever.k` of
     them without replacement from softmax(score / temperature), keeping their log-probs as old_logp
     (`generator_only: true` takes the top k instead and never trains the retriever);
  2. for each document the generator samples G answers to query + document: k * G generations per
     query, P * k * G per step;
  3. rewards score each answer; generator advantages are normalised within each document's G
     answers (GRPO-Clip per document group, KL to the frozen reference generator);
  4. a document's reward is the mean of its G answers' rewards; retriever advantages are
     normalised within the query's k documents; the retriever loss is PPO-clipped over the
     documents' log-probs plus KL to a frozen reference retriever.
Total loss = generator loss (aggregated over every document group) + retriever loss; each has its
own AdamW (the retriever with `retriever.learning_rate`).

Run it:  grpo-jobs run examples/joint-minimal.yaml --out runs/joint
"""

from __future__ import annotations

import copy
import math
import random
import time

import torch
from safetensors.torch import load_model, save_model

from service.settings import Settings
from service.specs import JointJob
from worker import rewards as R
from worker.algos.advantages import group_advantages
from worker.algos.retrieval import categorical_entropy, retriever_loss, sample_without_replacement, sequential_logprobs
from worker.datasets import Example, load_retrieval_task, rag_question, render_prompt
from worker.loops import steps as S
from worker.reporting import Reporter
from worker.retriever import DualEncoder, load_retriever
from worker.rollout import RolloutBatch
from worker.sparsity_hook import SparsityTracker
from worker.training import make_optimizer, seed_everything, step_seed

RETRIEVER_FILE = "retriever.safetensors"


class Index:
    """Document embeddings of the whole corpus under the current document tower."""

    def __init__(self, retriever: DualEncoder, corpus: list[tuple[str, str]]) -> None:
        self.retriever, self.ids, self.texts = retriever, [c[0] for c in corpus], [c[1] for c in corpus]
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        self.emb = self.retriever.documents(self.texts)  # [D, h]

    def candidates(self, q: torch.Tensor, n: int) -> torch.Tensor:
        """The n best documents for each query embedding. q: [P, h] -> [P, n]."""
        return torch.topk(self.retriever.scores(q.detach(), self.emb), min(n, len(self.ids)), dim=-1).indices


def _retrieve(spec: JointJob, retriever: DualEncoder, ref: DualEncoder, index: Index, queries: list[Example],
              gen: torch.Generator, *, greedy: bool):
    """Per query: candidate pool, logits over it (with grad), the k picks and their old log-probs."""
    r = spec.retriever
    q = retriever.queries([ex.question for ex in queries])  # [P, h]
    pools = index.candidates(q, r.candidates)  # [P, C]
    out = []
    for i, pool in enumerate(pools):
        texts = [index.texts[j] for j in pool.tolist()]
        logits = retriever.scores(q[i], retriever.documents(texts)) / r.temperature  # [C]
        picks = torch.arange(r.k) if greedy else sample_without_replacement(logits, r.k, gen)  # positions in pool
        with torch.no_grad():
            ref_logits = ref.scores(ref.queries([queries[i].question])[0], ref.documents(texts)) / r.temperature
        out.append({"pool": pool, "logits": logits, "picks": picks, "ref_logits": ref_logits,
                    "old_logp": sequential_logprobs(logits.detach(), picks)})
    return out


def _generate(s: S.Setup, queries: list[Example], picks: list[dict], index: Index, reporter: Reporter, step: int,
              *, greedy: bool = False):
    """G answers to each (query, document) pair; groups are prompt-major over the P*k pairs."""
    g = s.spec.grpo
    G = 1 if greedy else g.num_generations
    pairs, prompts = [], []
    for ex, p in zip(queries, picks):
        for j in p["pool"][p["picks"]].tolist():
            pairs.append((ex, j))
            prompts.append(render_prompt(s.tokenizer, rag_question(ex.question, index.texts[j]), s.task.instruction,
                                         chat=s.spec.dataset.chat_template))
    batches = [s.engine.generate(prompts[i:i + g.micro_batch_size], G, greedy=greedy)
               for i in range(0, len(prompts), g.micro_batch_size)]
    batch = RolloutBatch.cat(batches, s.tokenizer.pad_token_id)
    rewards, excluded, per_fn = S.score_groups(batch.completions, [ex for ex, _ in pairs], G, s.weights, reporter, step)
    return pairs, prompts, batch, rewards, excluded, per_fn


def _save_retriever(path, retriever: DualEncoder) -> None:
    save_model(retriever, str(path / RETRIEVER_FILE))


@torch.no_grad()
def evaluate(s: S.Setup, spec: JointJob, retriever: DualEncoder, index: Index, reporter: Reporter) -> dict[str, float]:
    """Greedy: the top-1 document, then a greedy answer. Recall@1 where gold documents are known."""
    val = s.task.val[: spec.grpo.eval_prompts]
    s.engine.sync(s.model)
    q = retriever.queries([ex.question for ex in val])
    top1 = index.candidates(q, 1)[:, 0].tolist()
    hits = [index.ids[j] == ex.meta.get("gold_doc_id") for ex, j in zip(val, top1) if "gold_doc_id" in ex.meta]
    prompts = [render_prompt(s.tokenizer, rag_question(ex.question, index.texts[j]), s.task.instruction,
                             chat=spec.dataset.chat_template) for ex, j in zip(val, top1)]
    completions = []
    for i in range(0, len(prompts), spec.grpo.micro_batch_size):
        completions += s.engine.generate(prompts[i:i + spec.grpo.micro_batch_size], 1, greedy=True).completions
    scored = R.score(completions, [ex.answers for ex in val], s.weights)
    out = {"eval/reward_mean": sum(v for v in scored.total if not math.isnan(v)) / max(1, len(val)),
           "eval/accuracy": sum(R.exact_match(c, ex.answers) for c, ex in zip(completions, val)) / max(1, len(val)),
           "eval/token_f1": sum(R.token_f1(c, ex.answers) for c, ex in zip(completions, val)) / max(1, len(val))}
    if hits:
        out["eval/retriever_recall_at_1"] = sum(hits) / len(hits)
    return out


def run(spec: JointJob, reporter: Reporter, *, settings: Settings) -> dict:
    g, r = spec.grpo, spec.retriever
    seed_everything(g.seed)
    task, corpus = load_retrieval_task(spec.dataset, settings=settings)
    s = S.build(spec, settings, reporter, task=task)
    retriever = load_retriever(r, device=spec.devices.policy, seed=g.seed, model_roots=settings.model_roots)
    ref = copy.deepcopy(retriever).eval().requires_grad_(False)  # frozen reference retriever
    train_retriever = not r.generator_only
    if not train_retriever:
        retriever.requires_grad_(False)
    ret_opt = make_optimizer(retriever.parameters(), lr=r.learning_rate, weight_decay=0.0, betas=g.betas)
    extra = {"retriever": ret_opt} if train_retriever else {}
    S.resume_if_possible(s, reporter)
    ckpt = s.start_step and (reporter.checkpoint_root / f"step-{s.start_step}")
    if ckpt and (ckpt / RETRIEVER_FILE).exists():
        load_model(retriever, str(ckpt / RETRIEVER_FILE))
        if train_retriever:
            ret_opt.load_state_dict(torch.load(ckpt / "trainer_state.pt", weights_only=False)["optimizers"]["retriever"])
    index = Index(retriever, corpus)
    reporter.event("corpus_indexed", f"{len(corpus)} documents; {r.k} x {g.num_generations} generations per query",
                   data={"documents": len(corpus), "generations_per_step": g.prompts_per_step * r.k * g.num_generations})
    tracker = SparsityTracker.maybe(spec, s, reporter)

    def save(step: int) -> None:
        path = S.checkpoint(s, reporter, step, extra_optimizers=extra)
        _save_retriever(path, retriever)

    last_eval = {}
    if s.start_step == 0:
        last_eval = evaluate(s, spec, retriever, index, reporter)
        reporter.metrics(0, last_eval)
    for step in range(s.start_step + 1, g.steps + 1):
        if reporter.should_stop():
            save(step - 1)
            reporter.event("cancelled", f"stopped before step {step}; checkpoint saved")
            return {"status": "cancelled", "step": step - 1}
        t0 = time.perf_counter()
        seed_everything(step_seed(g.seed, step))
        if (step - 1) % r.refresh_every == 0:
            index.refresh()

        # 1. retrieve k documents per query
        rng = random.Random(f"queries-{g.seed}-{step}")
        queries = [task.train[rng.randrange(len(task.train))] for _ in range(g.prompts_per_step)]
        retriever.train(train_retriever)
        picks = _retrieve(spec, retriever, ref, index, queries, torch.Generator().manual_seed(step_seed(g.seed, step)),
                          greedy=not train_retriever)

        # 2-3. G answers per document; generator advantages within each document's group
        s.engine.sync(s.model)
        pairs, prompts, batch, rewards, excluded, per_fn = _generate(s, queries, picks, index, reporter, step)
        adv = group_advantages(rewards, g.num_generations, normalize=g.normalize_advantages, eps=g.advantage_eps)
        loss_mask = batch.completion_mask.clone()
        loss_mask[excluded] = 0
        if g.mask_truncated_completions:
            loss_mask[batch.truncated] = 0
        ro = S.Rollouts(batch, [ex for ex, _ in pairs], prompts, rewards, adv, loss_mask, per_fn, 0.0,
                        g.num_generations)
        ro.frac_zero_std = float((rewards.view(-1, g.num_generations).std(1) == 0).float().mean())
        t_rollout = time.perf_counter() - t0

        # 4. retriever: document rewards, advantages within the k, PPO-clipped loss + KL
        doc_rewards = rewards.view(len(queries), r.k, g.num_generations).mean(-1)  # [P, k]
        doc_adv = group_advantages(doc_rewards.reshape(-1), r.k).view(len(queries), r.k)  # [P, k]
        ret_stats = {"retriever/reward_mean": float(doc_rewards.mean()),
                     "retriever/advantage_abs_mean": float(doc_adv.abs().mean()),
                     "retriever/entropy": float(sum(categorical_entropy(p["logits"].detach()) for p in picks) / len(picks))}
        gold = [ex.meta.get("gold_doc_id") for ex in queries]
        if all(gid is not None for gid in gold):
            ret_stats["retriever/gold_recall"] = sum(
                gid in {index.ids[j] for j in p["pool"][p["picks"]].tolist()} for gid, p in zip(gold, picks)) / len(picks)
        t1 = time.perf_counter()
        if train_retriever:
            ret_opt.zero_grad(set_to_none=True)
            losses, kls = [], []
            for p, a in zip(picks, doc_adv):
                logp = sequential_logprobs(p["logits"], p["picks"])
                loss, st = retriever_loss(logp, p["old_logp"], a, clip_eps=r.clip_eps, logits=p["logits"],
                                          ref_logits=p["ref_logits"], kl_coef=r.kl_coef)
                losses.append(loss)
                kls.append(float(st["retriever/kl"]))
            ret_loss = torch.stack(losses).mean()
            ret_loss.backward()
            torch.nn.utils.clip_grad_norm_(retriever.parameters(), g.max_grad_norm or float("inf"))
            ret_opt.step()
            ret_stats.update({"retriever/loss": float(ret_loss.detach()), "retriever/kl": sum(kls) / len(kls)})

        # generator: GRPO-Clip over every document group
        old_logp = S.old_logprobs(s, ro)
        ref_logp = S.reference_logprobs(s, ro.batch)
        train_stats = S.train_epochs(s, ro, old_logp, ref_logp, step,
                                     on_opt_step=tracker.on_optimizer_step if tracker else None)
        t_train = time.perf_counter() - t1

        metrics = {**S.rollout_metrics(ro), **train_stats, **ret_stats, **(tracker.pop_metrics() if tracker else {})}
        if g.eval_every and step % g.eval_every == 0 or step == g.steps:
            last_eval = evaluate(s, spec, retriever, index, reporter)
            metrics.update(last_eval)
        dt = time.perf_counter() - t0
        metrics.update({"time/rollout_s": t_rollout, "time/train_s": t_train, "time/step_s": dt,
                        "throughput/tokens_per_s": float(batch.completion_mask.sum()) / dt})
        reporter.metrics(step, metrics)
        if g.samples_per_step:
            rows = S.sample_rows(ro, g.samples_per_step)
            for row in rows:
                ex, j = pairs[row["index"] // g.num_generations]
                row["extra"] = {"doc_id": index.ids[j], "gold_doc_id": ex.meta.get("gold_doc_id")}
            reporter.samples(step, rows)
        reporter.progress(step)
        if g.checkpoint_every and step % g.checkpoint_every == 0 and step != g.steps:
            save(step)

    save(g.steps)
    return {"status": "succeeded", "step": g.steps, **last_eval}
