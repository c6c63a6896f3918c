"""Greedy evaluation on the validation split: eval/reward_mean and eval/accuracy. With several
processes each answers its share of the examples and the sums are reduced."""

from __future__ import annotations

import math

import torch

from worker import rewards
from worker.datasets import Example
from worker.environments.runner import EpisodeStats, episode_rewards, play
from worker.loops.setup import AnySpec, Setup
from worker.loops.sources import prompt_for


@torch.no_grad()
def greedy_completions(s: Setup[AnySpec], prompts: list[str], *, filler: str) -> list[str]:
    """One greedy completion per prompt from the rollout copy, synced with the policy first. A
    sharded policy's processes must run the same forwards: each pads its share with `filler` to
    the longest share and drops those answers."""
    s.engine.sync(s.model)
    n = len(prompts)
    if s.sharded:
        prompts = prompts + [filler] * (int(s.ranks.max({"n": n})["n"]) - n)
    bs = max(1, s.spec.train.micro_batch_size * 2)
    out = [c for i in range(0, len(prompts), bs) for c in s.engine.generate(prompts[i:i + bs], 1, greedy=True).completions]
    return out[:n]


def score_completions(s: Setup[AnySpec], completions: list[str], examples: list[Example], *, step: int,
                      extra: dict[str, float] | None = None) -> dict[str, float]:
    """eval/reward_mean (the job's weighted rewards) and eval/accuracy (dataset.accuracy's check)
    of one completion per example, over every rank's share; `extra` sums (over examples) are
    reduced alongside and returned as means."""
    correct = rewards.REGISTRY[s.spec.dataset.accuracy_check].fn
    scored = s.scorer.score([rewards.Item(ex.question, c, tuple(ex.answers)) for c, ex in zip(completions, examples)],
                            step=step)
    finite = [v for v in scored.total if not math.isnan(v)]
    t = s.ranks.sum({**(extra or {}), "reward": sum(finite), "scored": len(finite), "n": len(examples),
                     "correct": sum(correct(c, ex.answers) for c, ex in zip(completions, examples))})
    n = max(1.0, t["n"])
    return {"eval/reward_mean": t["reward"] / max(1.0, t["scored"]), "eval/accuracy": t["correct"] / n,
            **{k: t[k] / n for k in extra or {}}}


def shard(s: Setup[AnySpec], examples: list[Example]) -> list[Example]:
    """This rank's share of the examples."""
    return [examples[i] for i in s.ranks.share(len(examples))]


# what an evaluation reports of its episodes, beside their reward
EVAL_EPISODE_METRICS = ("env/turns_mean", "env/tool_calls_mean", "env/tool_errors_mean", "env/truncated_ratio",
                        "env/error_ratio")


def evaluate_episodes(s: Setup[AnySpec]) -> dict[str, float]:
    """environment.eval_episodes greedy episodes from reset seeds no training step draws: eval/reward_mean
    and eval/env/* (EVAL_EPISODE_METRICS)."""
    env = s.environment
    assert env is not None
    s.engine.sync(s.model)
    units = env.evaluation_units()
    episodes, played = play(env.players, env.url, list(range(units.first, units.first + units.count)), 1, env.limits,
                            seed_of=None, scheduler=env.scheduler, split=units.split)
    stats = EpisodeStats.of(episodes, played).metrics()
    return {"eval/reward_mean": float(episode_rewards(episodes, env.spec.reward).mean()),
            **{f"eval/{k}": stats[k] for k in EVAL_EPISODE_METRICS}}


def evaluate(s: Setup[AnySpec], step: int) -> dict[str, float]:
    """The first grpo.eval_prompts validation examples, answered greedily, after `step` (or, with an
    environment, its evaluation episodes)."""
    if s.environment is not None:
        return evaluate_episodes(s)
    every = s.task.val[: s.spec.train.eval_prompts]
    examples = shard(s, every)
    completions = greedy_completions(s, [prompt_for(s, ex) for ex in examples], filler=prompt_for(s, every[0]))
    return score_completions(s, completions, examples, step=step)
