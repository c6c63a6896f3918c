"""The pieces of a GRPO step that every loop shares: build, sample+score, train, evaluate, checkpoint."""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from service.settings import Settings
from service.specs import GRPOSpec, _JobBase
from worker import allocator
from worker import rewards as R
from worker.algos.advantages import group_advantages, zero_std_groups
from worker.algos.losses import policy_loss
from worker.datasets import Example, TaskData, load_task, render_prompt
from worker.models import is_lora, load_policy
from worker.reporting import Reporter
from worker.rollout import RolloutBatch, RolloutEngine, SamplingParams, sequence_logprobs
from worker.training import (
    grad_norm, latest_checkpoint, load_checkpoint, load_weights, make_optimizer, make_scheduler, save_checkpoint, trainable,
)


@dataclass
class Setup:
    """Everything a loop builds once per job."""

    spec: _JobBase
    model: torch.nn.Module
    tokenizer: object
    engine: RolloutEngine
    ref_model: torch.nn.Module | None  # full fine-tuning with KL only; LoRA disables the adapter instead
    optimizer: torch.optim.Optimizer
    scheduler: object
    task: TaskData
    weights: dict[str, float]
    device: torch.device
    start_step: int = 0
    opt_steps: int = 0  # optimizer steps taken (epochs count separately)


def build(spec: _JobBase, settings: Settings, reporter: Reporter, *, task: TaskData | None = None) -> Setup:
    g = spec.grpo
    device = torch.device(spec.devices.policy)
    model, tok = load_policy(spec.model, models_root=settings.models_dir, device=spec.devices.policy, seed=g.seed,
                             model_roots=settings.model_roots)
    if (init := spec.model.init_from) is not None:  # train on from an earlier checkpoint of the owner's
        load_weights(reporter.init_checkpoint(init.job, init.step), model=model)
        reporter.event("initialised", f"weights from job {init.job}, step {init.step}",
                       data={"job": init.job, "step": init.step})
    if device.type == "cpu" and settings.keep_freed_memory:
        allocator.release_freed_memory()  # what loading and converting the weights used
        allocator.keep_freed_memory()  # from here on, each step reuses the pages of the last one
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in model.parameters())
    reporter.event("model_loaded", f"{spec.model.name}: {n_train:,} trainable of {n_all:,} parameters",
                   data={"trainable": n_train, "total": n_all, "lora": spec.model.lora is not None})
    params = SamplingParams(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                            top_k=g.top_k, stop=tuple(g.stop))
    engine = RolloutEngine(model, tok, spec.devices.rollout or spec.devices.policy, params)
    ref = None
    if g.kl_coef > 0 and not is_lora(model):
        ref = copy.deepcopy(model).eval().requires_grad_(False)
    opt = make_optimizer(trainable(model), lr=g.learning_rate, weight_decay=g.weight_decay, betas=g.betas)
    total_opt = g.steps * g.epochs_per_rollout_batch
    sched = make_scheduler(opt, schedule=g.lr_schedule, warmup=g.warmup_steps * g.epochs_per_rollout_batch,
                           total=total_opt)
    weights = {r.name: r.weight for r in spec.reward_specs()}
    if task is None:
        task = load_task(spec.dataset, settings=settings, reward_names=list(weights))
    return Setup(spec, model, tok, engine, ref, opt, sched, task, weights, device)


def resume_if_possible(s: Setup, reporter: Reporter) -> None:
    ckpt = latest_checkpoint(reporter.checkpoint_root)
    if ckpt is None:
        return
    state = load_checkpoint(ckpt, model=s.model, optimizers={"policy": s.optimizer}, schedulers={"policy": s.scheduler})
    s.start_step = int(state["step"])
    s.opt_steps = int(state["extra"].get("opt_steps", s.start_step * s.spec.grpo.epochs_per_rollout_batch))
    reporter.event("resumed", f"resumed from checkpoint at step {s.start_step}", data={"step": s.start_step})


def initial_eval(s: Setup, reporter: Reporter) -> dict[str, float]:
    """Evaluate before the first step (not again after a resume) and report it as step 0."""
    if s.start_step:
        return {}
    ev = evaluate(s)
    reporter.metrics(0, ev)
    return ev


def stop_requested(s: Setup, reporter: Reporter, step: int) -> dict | None:
    """Cooperative cancel, checked between steps: checkpoint what was done and say so."""
    if not reporter.should_stop():
        return None
    checkpoint(s, reporter, step - 1)
    reporter.event("stopping", f"cancel requested: stopped before step {step}; checkpoint saved")
    return {"status": "cancelled", "step": step - 1}


def checkpoint(s: Setup, reporter: Reporter, step: int, *, extra_optimizers: dict | None = None,
               extra_schedulers: dict | None = None) -> Path:
    path = reporter.checkpoint_root / f"step-{step}"
    fmt, size = save_checkpoint(path, model=s.model, tokenizer=s.tokenizer,
                                optimizers={"policy": s.optimizer, **(extra_optimizers or {})},
                                schedulers={"policy": s.scheduler, **(extra_schedulers or {})},
                                step=step, extra={"opt_steps": s.opt_steps})
    reporter.checkpoint(step, path, fmt, size)
    reporter.event("checkpoint", f"checkpoint at step {step} ({size / 1e6:.1f} MB)",
                   data={"step": step, "format": fmt, "size_bytes": size})
    return path


@dataclass
class Rollouts:
    """One step's scored rollouts, prompt-major: row i belongs to prompt i // G."""

    batch: RolloutBatch
    examples: list[Example]  # [P]
    prompts: list[str]  # [P]
    rewards: torch.Tensor  # [P*G], excluded completions hold their group's mean
    advantages: torch.Tensor  # [P*G]
    loss_mask: torch.Tensor  # [P*G, T]
    per_fn: dict[str, list[float]]
    frac_zero_std: float
    group_size: int
    stats: dict = field(default_factory=dict)


def prompt_for(s: Setup, ex: Example) -> str:
    return render_prompt(s.tokenizer, ex.question, s.task.instruction, chat=s.spec.dataset.chat_template)


def score_groups(completions: list[str], examples: list[Example], G: int, weights: dict[str, float],
                 reporter: Reporter, step: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, list[float]]]:
    """Rewards [N] and an exclusion mask [N] (True = a reward function raised on it)."""
    answers = [ex.answers for ex in examples for _ in range(G)]
    scored = R.score(completions, answers, weights)
    if scored.failures:
        reporter.event("warning", f"{len(scored.failures)} reward evaluations raised at step {step}; "
                       "those completions are excluded from the loss", level="warning",
                       data={"failures": [{"index": i, "reward": n, "error": e} for i, n, e in scored.failures[:20]]})
    rewards = torch.tensor(scored.total, dtype=torch.float32)
    excluded = torch.isnan(rewards)
    if excluded.any():  # excluded completions take their group's mean: zero advantage, no effect on the baseline
        grouped = rewards.view(-1, G)
        means = torch.nanmean(grouped, dim=1, keepdim=True).nan_to_num(0.0).expand_as(grouped)
        rewards = torch.where(torch.isnan(grouped), means, grouped).reshape(-1)
    return rewards, excluded, scored.per_fn


def collect_rollouts(s: Setup, step: int, reporter: Reporter, *, examples_pool: list[Example] | None = None,
                     prompts_per_step: int | None = None, group_size: int | None = None,
                     tag: str = "train", drop_zero_std: bool | None = None) -> Rollouts | None:
    """Sample P prompts, G completions each, score and normalise per group.

    With drop_zero_std_groups, groups whose rewards all tie are dropped and fresh prompts fill the
    batch, up to max_refill_rounds times. Returns None when no group is left.
    """
    g: GRPOSpec = s.spec.grpo
    G, P = group_size or g.num_generations, prompts_per_step or g.prompts_per_step
    pool = examples_pool or s.task.train
    rng = random.Random(f"prompts-{tag}-{g.seed}-{step}")
    kept: list[tuple[RolloutBatch, list[Example], torch.Tensor, torch.Tensor, dict, list[str]]] = []
    frac_zero = None
    need, rounds = P, 0
    while need > 0:
        examples = [pool[rng.randrange(len(pool))] for _ in range(need)]
        prompts = [prompt_for(s, ex) for ex in examples]
        batch = s.engine.generate(prompts, G)
        assert len(batch) == len(prompts) * G, f"expected {len(prompts) * G} completions, got {len(batch)}"
        rewards, excluded, per_fn = score_groups(batch.completions, examples, G, s.weights, reporter, step)
        zero = zero_std_groups(rewards, G)  # [need]
        frac_zero = float(zero.float().mean()) if frac_zero is None else frac_zero
        drop = g.drop_zero_std_groups if drop_zero_std is None else drop_zero_std
        keep = ~zero if drop else torch.ones_like(zero)
        if keep.any():
            rows = torch.arange(len(batch)).view(-1, G)[keep].reshape(-1)
            kept.append((batch.select(rows), [ex for ex, k in zip(examples, keep) if k], rewards[rows],
                         excluded[rows], {k: [v[i] for i in rows.tolist()] for k, v in per_fn.items()},
                         [p for p, k in zip(prompts, keep) if k]))
        need -= int(keep.sum())
        rounds += 1
        if need > 0 and rounds > g.max_refill_rounds:
            break
    if not kept:
        return None
    pad_id = s.tokenizer.pad_token_id
    batch = RolloutBatch.cat([k[0] for k in kept], pad_id)
    examples = [ex for k in kept for ex in k[1]]
    rewards = torch.cat([k[2] for k in kept])
    excluded = torch.cat([k[3] for k in kept])
    per_fn = {name: [v for k in kept for v in k[4][name]] for name in kept[0][4]}
    adv = group_advantages(rewards, G, normalize=g.normalize_advantages, eps=g.advantage_eps)  # [P*G]
    # The runtime checks a careful GRPO implementation makes.
    grouped_adv = adv.view(-1, G)  # [P, G]
    assert grouped_adv.shape == (len(examples), G)
    assert torch.allclose(grouped_adv.mean(dim=1), torch.zeros(len(examples)), atol=1e-4), "advantages not centred"
    loss_mask = batch.completion_mask.clone()
    if g.mask_truncated_completions:
        loss_mask[batch.truncated] = 0
    loss_mask[excluded] = 0
    prompts = [p for k in kept for p in k[5]]
    reporter.event("groups", f"first groups of step {step}", level="debug", data={
        "rewards": rewards.view(-1, G)[:3].tolist(), "advantages": grouped_adv[:3].tolist()})
    return Rollouts(batch, examples, prompts, rewards, adv, loss_mask, per_fn, frac_zero or 0.0, G,
                    stats={"refill_rounds": rounds - 1})


def reference_logprobs(s: Setup, batch: RolloutBatch) -> torch.Tensor | None:
    """Log-probs under the frozen reference: the base model with the adapter disabled, or a copy."""
    g = s.spec.grpo
    if g.kl_coef == 0:
        return None
    parts = []
    with torch.no_grad():
        for i in range(0, len(batch), g.micro_batch_size):
            mb = batch.select(list(range(i, min(i + g.micro_batch_size, len(batch))))).to(s.device)
            if s.ref_model is None:
                with s.model.disable_adapter():
                    parts.append(sequence_logprobs(s.model, mb, g.temperature)[0])
            else:
                parts.append(sequence_logprobs(s.ref_model, mb, g.temperature)[0])
    return torch.cat(parts)


def micro_batches(n: int, size: int, *, shuffle_seed: int | None = None) -> list[list[int]]:
    order = list(range(n))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    return [order[i:i + size] for i in range(0, n, size)]


def old_logprobs(s: Setup, ro: Rollouts) -> torch.Tensor | None:
    """old_logp [N, T] from the rollout copy, needed from the second epoch on. With a single epoch
    the rollout copy holds exactly the policy's weights (synced at the start of the step), so the
    first training forward's detached log-probs are old_logp and the extra pass is skipped."""
    g = s.spec.grpo
    if g.epochs_per_rollout_batch == 1:
        return None
    return s.engine.logprobs(ro.batch, g.micro_batch_size)


def train_epochs(s: Setup, ro: Rollouts, old_logp: torch.Tensor | None, ref_logp: torch.Tensor | None, step: int,
                 *, rows: list[int] | None = None, whole_batch_weights: bool = False,
                 on_opt_step=None) -> dict[str, float]:
    """epochs_per_rollout_batch passes over the rollout batch (or its `rows`), each one optimizer
    step with gradient accumulation over micro-batches, weighted so the accumulated gradient is
    the gradient of the loss aggregated over the whole batch."""
    g = s.spec.grpo
    model = s.model
    model.train()
    rows = list(range(len(ro.batch))) if rows is None else rows
    # The loss is aggregated over `rows`, or, with whole_batch_weights, each row keeps its weight
    # in the whole batch's loss (the other rows simply contribute nothing).
    norm_rows = list(range(len(ro.batch))) if whole_batch_weights else rows
    total_tokens = float(ro.loss_mask[norm_rows].float().sum().clamp(min=1.0))
    acc: dict[str, float] = {}
    ratio_max, norms, ents, n_tok = 0.0, [], 0.0, 0.0
    for epoch in range(g.epochs_per_rollout_batch):
        s.optimizer.zero_grad(set_to_none=True)
        seed = None if epoch == 0 else hash((g.seed, step, epoch)) % 2**31
        for mb_local in micro_batches(len(rows), g.micro_batch_size, shuffle_seed=seed):
            idx = [rows[i] for i in mb_local]
            mb = ro.batch.select(idx).to(s.device)
            mask = ro.loss_mask[idx].to(s.device)
            logp, ent = sequence_logprobs(model, mb, g.temperature, with_entropy=True)
            # old_logp None: one epoch, so the rollout weights are the policy's and old = logp.detach()
            old = logp.detach() if old_logp is None else old_logp[idx].to(s.device)
            loss, st = policy_loss(
                logp, old, ro.advantages[idx].to(s.device), mask,
                ref_logp=None if ref_logp is None else ref_logp[idx].to(s.device),
                clip_eps_low=g.clip_eps_low, clip_eps_high=g.clip_eps_high, kl_coef=g.kl_coef, agg=g.loss_agg)
            mb_tokens = float(mask.sum())
            weight = mb_tokens / total_tokens if g.loss_agg == "token_mean" else len(idx) / len(norm_rows)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"loss is {loss.item()} at step {step} (epoch {epoch}); "
                                         "lower grpo.learning_rate or check the rewards")
            (loss * weight).backward()
            for k in ("loss/policy", "kl", "ratio/mean", "clip_ratio/region_mean"):
                acc[k] = acc.get(k, 0.0) + float(st[k]) * mb_tokens
            acc["loss/total"] = acc.get("loss/total", 0.0) + float(loss.detach()) * mb_tokens
            ratio_max = max(ratio_max, float(st["ratio/max"]))
            ents += float((ent * mask).sum())
            n_tok += mb_tokens
        params = [p for group in s.optimizer.param_groups for p in group["params"]]
        if g.max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, g.max_grad_norm)))
        else:
            norms.append(grad_norm(params))
        s.optimizer.step()
        s.scheduler.step()
        s.opt_steps += 1
        if on_opt_step is not None:
            on_opt_step(s.opt_steps)
    n_tok = max(n_tok, 1.0)
    out = {k: v / n_tok for k, v in acc.items()}
    out.update({"ratio/max": ratio_max, "entropy": ents / n_tok, "grad_norm": sum(norms) / len(norms),
                "lr": s.scheduler.get_last_lr()[0]})
    return out


def rollout_metrics(ro: Rollouts) -> dict[str, float]:
    r = ro.rewards
    m = {"reward/mean": float(r.mean()), "reward/std": float(r.std()) if len(r) > 1 else 0.0,
         "frac_reward_zero_std": ro.frac_zero_std, "advantage/abs_mean": float(ro.advantages.abs().mean()),
         "completions/mean_length": float(ro.batch.completion_mask.sum(1).float().mean()),
         "completions/clipped_ratio": float(ro.batch.truncated.float().mean())}
    if "refill_rounds" in ro.stats:  # generate calls beyond the first, to replace groups whose rewards tied
        m["rollout/refill_rounds"] = float(ro.stats["refill_rounds"])
    for name, vals in ro.per_fn.items():
        finite = [v for v in vals if not math.isnan(v)]
        if finite:
            m[f"reward/{name}/mean"] = sum(finite) / len(finite)
    return m


def sample_rows(ro: Rollouts, n: int, *, influence: list[float] | None = None,
                selected: list[bool] | None = None) -> list[dict]:
    rows = []
    for i in range(min(n, len(ro.batch))):
        rows.append({"index": i, "prompt": ro.prompts[i // ro.group_size], "completion": ro.batch.completions[i],
                     "reward": float(ro.rewards[i]), "advantage": float(ro.advantages[i]),
                     "influence": None if influence is None else float(influence[i]),
                     "selected": None if selected is None else bool(selected[i]), "extra": None})
    return rows


@torch.no_grad()
def evaluate(s: Setup, *, examples: list[Example] | None = None) -> dict[str, float]:
    """Greedy decoding on the validation split: eval/reward_mean and eval/accuracy."""
    g = s.spec.grpo
    examples = (examples or s.task.val)[: g.eval_prompts]
    s.engine.sync(s.model)
    correct_fn = R.numeric_match if s.spec.dataset.name == "arith" else R.exact_match
    rewards, correct = [], []
    bs = max(1, g.micro_batch_size * 2)
    for i in range(0, len(examples), bs):
        chunk = examples[i:i + bs]
        prompts = [prompt_for(s, ex) for ex in chunk]
        batch = s.engine.generate(prompts, 1, greedy=True)
        scored = R.score(batch.completions, [ex.answers for ex in chunk], s.weights)
        rewards += [v for v in scored.total if not math.isnan(v)]
        correct += [correct_fn(c, ex.answers) for c, ex in zip(batch.completions, chunk)]
    return {"eval/reward_mean": sum(rewards) / max(1, len(rewards)),
            "eval/accuracy": sum(correct) / max(1, len(correct))}
