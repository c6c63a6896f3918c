"""Collecting a step's rollouts: sample groups, score them, drop groups with no signal, refill.

Every kind samples in *units* that each yield groups of G completions: a prompt is one unit of one
group (GRPO, TracIn); a joint query is one unit of k groups, one per retrieved document. A unit
whose groups' rewards all tie carries no signal and, with `grpo.drop_zero_std_groups`, is dropped
and replaced by a fresh one, up to `grpo.max_refill_rounds` extra rounds; a tied group inside a
kept unit stays in the batch (the joint retriever needs its reward) but is left out of training.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Generic, TypeVar

import torch

from service.core import tracing
from service.core.records import SampleRow
from worker import rewards
from worker.algos.advantages import group_advantages, zero_std_groups
from worker.batch import RolloutBatch
from worker.datasets import Example, render_example
from worker.environments import episodes as episode_rows
from worker.environments.episodes import Episode
from worker.environments.runner import EpisodeStats, episode_rewards, play
from worker.loops.setup import Setup
from worker.parallel.distributed import SINGLE, Ranks, row_seed
from worker.reporting import Reporter

U = TypeVar("U")  # what a loop needs back about each unit: the Example, or a joint query's retrieval


@dataclass(frozen=True)
class Drawn(Generic[U]):
    """One generate call's groups, unit-major: groups_per_unit consecutive groups per unit. With
    several processes, this rank's share of the units drawn in one round."""

    batch: RolloutBatch  # [n_groups * G] completions, group-major
    examples: list[Example]  # [n_groups] what each group is scored against
    prompts: list[str]  # [n_groups] the text each group was sampled from
    units: list[U]  # [n_units]
    keys: list[tuple[int, int]]  # [n_units] (round, index among the round's units on every rank)
    groups_per_unit: int = 1
    scored: GroupRewards | None = None  # rewards that came with the draw (an environment's); None: score them
    episodes: list[Episode] | None = None  # [n_groups * G] the episodes the rows were built from
    stats: EpisodeStats | None = None  # the draw's episodes, summed up


Draw = Callable[[int, int], Drawn[U]]  # (round, n_units on every rank) -> this rank's share, sampled
Sampling = Callable[[], Drawn[U]]  # a draw whose completions the engine is still sampling: waits, gives it
Submit = Callable[[int, int], Sampling[U]]  # a Draw that returns as soon as the sampling has started


def unit_draws(rng: random.Random, pool: list, n: int, ranks: Ranks) -> tuple[list, list[int]]:
    """n units drawn (with replacement) from `pool` by every rank alike; this rank's share and
    their indices among the n."""
    drawn = [pool[rng.randrange(len(pool))] for _ in range(n)]
    mine = ranks.share(n)
    return [drawn[i] for i in mine], list(mine)


@dataclass(frozen=True)
class Rollouts(Generic[U]):
    """One step's scored rollouts, group-major: row i belongs to group i // G."""

    batch: RolloutBatch  # [N = n_groups * G]
    examples: list[Example]  # [n_groups]
    prompts: list[str]  # [n_groups]
    units: list[U]  # [n_units]
    groups_per_unit: int
    group_size: int  # G
    rewards: torch.Tensor  # [N], excluded completions hold their group's mean
    advantages: torch.Tensor  # [N]
    loss_mask: torch.Tensor  # [N, T]
    per_fn: dict[str, list[float]]  # reward name -> [N] (NaN where it could not score)
    train_rows: list[int]  # rows that enter the loss (all, unless tied groups are dropped)
    frac_zero_std: float  # tied groups among the first round's
    refill_rounds: int  # generate calls beyond the first
    reward_s: float  # wall time spent scoring, every round
    keys: list[tuple[int, int, int, int]]  # [N] (round, unit, group in unit, g): a row's place in the whole step
    staleness: torch.Tensor | None = None  # [N] weight versions between each row's sampler and now (vllm)
    ranks: Ranks = SINGLE
    excluded: torch.Tensor | None = None  # [N] bool: no counted reward could score it (None: every row scored)
    episodes: list[Episode] | None = None  # [N] each row's episode (a job with an environment)
    episode_stats: EpisodeStats | None = None  # every episode the step played, refills included

    def __len__(self) -> int:
        """Rows on this rank."""
        return len(self.batch)

    @cached_property
    def _layout(self) -> list[list[int]]:
        """Per rank, its rows' indices in the whole step's batch (all ranks' rows, in the order one
        process would hold them): one gather of every rank's row keys, once per step."""
        every_rank = self.ranks.gather(self.keys)
        where = {k: i for i, k in enumerate(sorted(k for keys in every_rank for k in keys))}
        return [[where[k] for k in keys] for keys in every_rank]

    @property
    def positions(self) -> list[int]:
        """[N] each of this rank's rows' index in the whole step's batch."""
        return self._layout[self.ranks.rank]

    @property
    def total(self) -> int:
        """Rows on every rank."""
        return int(self.ranks.sum({"n": len(self)})["n"])

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """A per-row tensor [N, ...] of every rank, in the whole step's order."""
        out = self.ranks.cat(values)
        order = torch.tensor([p for ps in self._layout for p in ps], dtype=torch.long)
        return out[torch.argsort(order)]

    def metrics(self) -> dict[str, float]:
        """Reward, advantage and completion statistics of the whole step (every rank's rows)."""
        lengths = self.batch.completion_mask.sum(1).double()
        # rewards of the scored rows only: an excluded row holds its group's mean, which is not a measurement
        r = self.rewards.double() if self.excluded is None else self.rewards.double()[~self.excluded]
        sums = {"n": len(self.rewards), "n_scored": len(r), "r": float(r.sum()), "r2": float((r * r).sum()),
                "adv": float(self.advantages.abs().sum()),
                "len": float(lengths.sum()), "trunc": float(self.batch.truncated.sum()), "reward_s": self.reward_s}
        for name, vals in self.per_fn.items():
            finite = [v for v in vals if not math.isnan(v)]
            sums[f"fn/{name}"], sums[f"fn_n/{name}"] = sum(finite), len(finite)
        if self.staleness is not None:
            sums["stale"] = float(self.staleness.sum())
        t = self.ranks.sum(sums)
        n, scored = max(t["n"], 1.0), t["n_scored"]
        m = {"frac_reward_zero_std": self.frac_zero_std, "advantage/abs_mean": t["adv"] / n, "completions/mean_length": t["len"] / n,
             "completions/clipped_ratio": t["trunc"] / n, "rollout/refill_rounds": float(self.refill_rounds),
             "time/reward_s": t["reward_s"] / self.ranks.world}
        if scored:  # nothing scored: no reward was measured, and none is reported
            mean = t["r"] / scored
            var = (t["r2"] - scored * mean * mean) / (scored - 1) if scored > 1 else 0.0
            m |= {"reward/mean": mean, "reward/std": math.sqrt(max(var, 0.0))}
        for name in self.per_fn:
            if t[f"fn_n/{name}"]:
                m[f"reward/{name}/mean"] = t[f"fn/{name}"] / t[f"fn_n/{name}"]
        if "stale" in t:
            m["rollout/staleness"] = t["stale"] / n
        if self.episode_stats is not None:
            m |= self.episode_stats.metrics()
        return m

    def sample_rows(self, n: int, *, influence: list[float] | None = None, selected: list[bool] | None = None,
                    extra: Callable[[int], dict[str, Any]] | None = None) -> list[SampleRow]:
        """The whole step's first n completions as records (gathered from every rank); `extra(group)`
        adds what a kind knows about one of this rank's groups."""
        G = self.group_size

        def more(i: int) -> dict[str, Any] | None:
            out = {} if extra is None else dict(extra(i // G))
            if self.episodes is not None:
                out["episode"] = episode_rows.record(self.episodes[i])
            return out or None

        mine = [SampleRow(index=p, prompt=self.prompts[i // G], completion=self.batch.completions[i],
                          reward=float(self.rewards[i]), advantage=float(self.advantages[i]),
                          influence=None if influence is None else float(influence[i]),
                          selected=None if selected is None else bool(selected[i]), extra=more(i))
                for i, p in enumerate(self.positions) if p < n]
        return sorted((row for rows in self.ranks.gather(mine) for row in rows), key=lambda row: row.index)


@dataclass
class _Scored:
    """A Drawn after scoring."""

    drawn: Drawn
    rewards: torch.Tensor  # [N]
    excluded: torch.Tensor  # [N] bool: a reward function raised on it
    per_fn: dict[str, list[float]] = field(default_factory=dict)

    def keep_units(self, keep: torch.Tensor, G: int) -> _Scored:
        """The groups of units where keep [n_units] is True."""
        d = self.drawn
        groups = keep.repeat_interleave(d.groups_per_unit)  # [n_groups]
        rows = torch.arange(len(d.batch)).view(-1, G)[groups].reshape(-1)
        g_idx = groups.nonzero().flatten().tolist()
        kept = replace(d, batch=d.batch.select(rows), examples=[d.examples[i] for i in g_idx],
                       prompts=[d.prompts[i] for i in g_idx], units=[u for u, k in zip(d.units, keep) if k],
                       keys=[u for u, k in zip(d.keys, keep) if k])
        r = rows.tolist()
        if d.episodes is not None:
            kept = replace(kept, episodes=[d.episodes[i] for i in r])
        return _Scored(kept, self.rewards[rows], self.excluded[rows], {n: [v[i] for i in r] for n, v in self.per_fn.items()})


def prompt_for(s: Setup, ex: Example) -> str:
    return render_example(s.tokenizer, ex, s.task.instruction, chat=s.spec.dataset.chat_template)


@dataclass(frozen=True)
class GroupRewards:
    """A round's completions, scored."""

    rewards: torch.Tensor  # [N]; an excluded completion holds its group's mean
    excluded: torch.Tensor  # bool [N]: a counted reward could not score it
    scored: rewards.Scored  # every entry's scores, and the time they took


def score_groups(s: Setup, completions: list[str], examples: list[Example], G: int, step: int) -> GroupRewards:
    """Rewards [N] and an exclusion mask [N] (True: a counted reward could not score it)."""
    items = [rewards.Item(ex.question, c, tuple(ex.answers)) for ex, c in
             zip((ex for ex in examples for _ in range(G)), completions, strict=True)]
    scored = s.scorer.score(items, step=step)  # failures become the job's warning event (setup.warn_reward_failures)
    return with_exclusions(scored, G)


def with_exclusions(scored: rewards.Scored, G: int) -> GroupRewards:
    """Rewards whose NaN entries (nothing could score them) are excluded and take their group's mean:
    zero advantage, no effect on the baseline."""
    r = torch.tensor(scored.total, dtype=torch.float32)
    excluded = torch.isnan(r)
    if excluded.any():
        grouped = r.view(-1, G)
        means = torch.nanmean(grouped, dim=1, keepdim=True).nan_to_num(0.0).expand_as(grouped)
        r = torch.where(torch.isnan(grouped), means, grouped).reshape(-1)
    return GroupRewards(rewards=r, excluded=excluded, scored=scored)


def episode_scores(s: Setup, episodes: list[Episode], G: int) -> GroupRewards:
    """The environment's rewards of a draw's episodes [N]: with environment.on_error `drop_group`, every
    episode of a group the environment failed in is excluded; with `zero`, a failed episode keeps what it
    earned (0 if nothing)."""
    env = s.spec.environment
    r = episode_rewards(episodes, env.reward)
    if env.on_error == "drop_group":
        failed = torch.tensor([e.error is not None for e in episodes]).view(-1, G).any(1)  # [n_groups]
        r = torch.where(failed.repeat_interleave(G), torch.full_like(r, float("nan")), r)
    return with_exclusions(rewards.Scored(total=r.tolist(), per_fn={}, failures=[]), G)  # its time is time/env_s


def submit_prompts(s: Setup, pool: list[Example], G: int, *, seed_tag: str) -> Submit[Example]:
    """Units are prompts drawn (with replacement, seeded by `seed_tag`) from `pool`; one group each,
    sampled with seeds from (seed_tag, round, unit)."""
    rng = random.Random(seed_tag)

    def submit(round: int, n: int) -> Sampling[Example]:
        examples, idx = unit_draws(rng, pool, n, s.ranks)
        prompts = [prompt_for(s, ex) for ex in examples]
        sampled = s.engine.submit(prompts, G, seeds=[row_seed(seed_tag, round, i) for i in idx])
        return lambda: Drawn(batch=sampled(), examples=examples, prompts=prompts, units=examples,
                             keys=[(round, i) for i in idx])

    return submit


# Reset seeds: training draws below EVAL_SEEDS, evaluation plays EVAL_SEEDS, EVAL_SEEDS + 1, ...
EVAL_SEEDS = 2**31


def submit_episodes(s: Setup, G: int, *, seed_tag: str, validation: bool = False) -> Submit[Example]:
    """Units are reset seeds of the job's environment (drawn with `seed_tag`; `validation`: among its
    evaluation seeds), a group of G episodes each, played now; each turn sampled with a seed from
    (seed_tag, round, episode, turn)."""
    rng, env = random.Random(seed_tag), s.environment
    assert env is not None

    def submit(round: int, n: int) -> Sampling[Example]:
        seeds = [EVAL_SEEDS + rng.randrange(env.spec.eval_episodes) if validation else rng.randrange(EVAL_SEEDS)
                 for _ in range(n)]
        with tracing.span("rl.episodes", **{"grpo_jobs.round": round}):
            episodes, env_s = play(env.players, env.url, seeds, G, env.limits,
                                   seed_of=lambda i, turn: row_seed(seed_tag, round, i, turn), stop=env.stop)
        batch = episode_rows.rows(episodes, s.tokenizer.pad_token_id)
        firsts = [Example(question=episodes[i * G].first_observation, answers=(), meta={"seed": seed})
                  for i, seed in enumerate(seeds)]
        drawn = Drawn(batch=batch, examples=firsts, prompts=[ex.question for ex in firsts], units=firsts,
                      keys=[(round, i) for i in range(n)], scored=episode_scores(s, episodes, G),
                      episodes=episodes, stats=EpisodeStats.of(episodes, env_s))
        return lambda: drawn

    return submit


def draw_prompts(s: Setup, pool: list[Example], G: int, *, seed_tag: str) -> Draw[Example]:
    """submit_prompts, waiting for each draw's completions."""
    submit = submit_prompts(s, pool, G, seed_tag=seed_tag)
    return lambda round, n: submit(round, n)()


def draw_validation(s: Setup, G: int, *, seed_tag: str) -> Draw[Example]:
    """Groups from the validation split: its prompts, or an environment's evaluation seeds."""
    if s.environment is not None:
        submit = submit_episodes(s, G, seed_tag=seed_tag, validation=True)
        return lambda round, n: submit(round, n)()
    return draw_prompts(s, s.task.val, G, seed_tag=seed_tag)


def _sample_round(draw: Draw[U], round: int, need: int, G: int, *, first: Sampling[U] | None) -> Drawn[U]:
    """One sampling round (`first`: its draw submitted earlier), checked for a group of G per prompt."""
    with tracing.span("rl.sample", **{"grpo_jobs.round": round}):
        d = first() if first is not None else draw(round, need)
    if len(d.batch) != len(d.prompts) * G or len(d.prompts) != len(d.units) * d.groups_per_unit:
        raise RuntimeError(f"the sampler returned {len(d.batch)} completions for {len(d.prompts)} groups of "
                           f"{G} from {len(d.units)} units; expected {len(d.units) * d.groups_per_unit * G}")
    return d


def grade(s: Setup, d: Drawn, G: int, step: int) -> GroupRewards:
    """A draw's rewards: the environment's that came with it, or the job's reward functions'."""
    if d.scored is not None:
        return d.scored
    with tracing.span("rl.reward", **{"grpo_jobs.completions": len(d.batch)}):
        return score_groups(s, d.batch.completions, d.examples, G, step)


def collect_rollouts(s: Setup, step: int, reporter: Reporter, draw: Draw[U], *, units: int, group_size: int,
                     drop_zero_std: bool | None = None, first: Sampling[U] | None = None) -> Rollouts[U] | None:
    """`units` units' groups, scored, with group-normalised advantages; None when every unit tied.

    With dropping (default: grpo.drop_zero_std_groups), tied units are replaced by fresh ones for
    up to grpo.max_refill_rounds more rounds, and tied groups of kept units are left out of training.
    `first`: round 0's draw of all `units`, submitted earlier (max_staleness 1).
    """
    g, G = s.spec.grpo, group_size
    drop = g.drop_zero_std_groups if drop_zero_std is None else drop_zero_std
    kept: list[_Scored] = []
    frac_zero: float | None = None
    need, rounds, reward_s = units, 0, 0.0
    played: list[EpisodeStats] = []  # every round's episodes (a job with an environment)
    while need > 0:  # `need` is the same on every rank: each round draws and keeps over all of them
        d = _sample_round(draw, rounds, need, G, first=first if rounds == 0 else None)
        played.extend([d.stats] if d.stats is not None else [])
        r, excluded, scored = (graded := grade(s, d, G, step)).rewards, graded.excluded, graded.scored
        reward_s += scored.seconds
        tied = zero_std_groups(r, G)  # [n_groups]
        keep = ~tied.view(-1, d.groups_per_unit).all(1) if drop else torch.ones(len(d.units), dtype=torch.bool)
        counts = s.ranks.sum({"tied": float(tied.sum()), "groups": len(tied), "kept": float(keep.sum())})
        if frac_zero is None:
            frac_zero = counts["tied"] / max(counts["groups"], 1.0)
        if keep.any():
            kept.append(_Scored(d, r, excluded, scored.per_fn).keep_units(keep, G))
        need -= int(counts["kept"])
        rounds += 1
        if need > 0 and rounds > g.max_refill_rounds:
            break
    if need == units:  # nothing kept on any rank
        return None
    if not kept:  # this rank kept nothing; the others did
        kept.append(_Scored(d, r, excluded, scored.per_fn).keep_units(torch.zeros(len(d.units), dtype=torch.bool), G))
    batch = RolloutBatch.cat([k.drawn.batch for k in kept], s.tokenizer.pad_token_id)
    r = torch.cat([k.rewards for k in kept])  # [N]
    excluded = torch.cat([k.excluded for k in kept])  # [N]
    adv = group_advantages(r, G, normalize=g.normalize_advantages, eps=g.advantage_eps)  # [N]
    grouped_adv = adv.view(-1, G)  # [n_groups, G]
    if not torch.allclose(grouped_adv.mean(dim=1), torch.zeros(len(grouped_adv)), atol=1e-4):
        raise RuntimeError(f"step {step}: group advantages are not centred (rewards {r.view(-1, G)[:3].tolist()})")
    loss_mask = batch.loss_mask().clone()  # an episode's environment tokens are context, never trained
    if g.mask_truncated_completions:
        loss_mask[batch.truncated] = 0
    loss_mask[excluded] = 0
    tied = zero_std_groups(r, G)  # [n_groups]
    train_rows = torch.arange(len(batch)).view(-1, G)[~tied].reshape(-1).tolist() if drop else list(range(len(batch)))
    reporter.event("groups", f"first groups of step {step}", level="debug", data={
        "rewards": r.view(-1, G)[:3].tolist(), "advantages": grouped_adv[:3].tolist()})
    first = kept[0].drawn
    keys = [(*key, j, g) for k in kept for key in k.drawn.keys for j in range(k.drawn.groups_per_unit) for g in range(G)]
    stale = None if batch.version is None else (s.engine.version - batch.version).float().cpu()
    return Rollouts(batch=batch, examples=[ex for k in kept for ex in k.drawn.examples],
                    prompts=[p for k in kept for p in k.drawn.prompts], units=[u for k in kept for u in k.drawn.units],
                    groups_per_unit=first.groups_per_unit, group_size=G, rewards=r, advantages=adv, loss_mask=loss_mask,
                    per_fn={name: [v for k in kept for v in k.per_fn[name]] for name in kept[0].per_fn},
                    train_rows=train_rows, frac_zero_std=frac_zero or 0.0, refill_rounds=rounds - 1, reward_s=reward_s,
                    keys=keys, staleness=stale, ranks=s.ranks, excluded=excluded,
                    episodes=None if first.episodes is None else [e for k in kept for e in k.drawn.episodes],
                    episode_stats=EpisodeStats.total(played))


def submit_train_prompts(s: Setup, step: int) -> Submit[Example]:
    """The draws of step `step`'s training prompts."""
    g = s.spec.grpo
    tag = f"prompts-train-{g.seed}-{step}"
    if s.environment is not None:
        return submit_episodes(s, g.num_generations, seed_tag=tag)
    return submit_prompts(s, s.task.train, g.num_generations, seed_tag=tag)


def collect_train_rollouts(s: Setup, step: int, reporter: Reporter, *, submit: Submit[Example] | None = None,
                           first: Sampling[Example] | None = None) -> Rollouts[Example] | None:
    """The step's grpo.prompts_per_step training prompts, grpo.num_generations completions each;
    round 0 from `first` where it was submitted ahead (by `submit`, which draws the refills)."""
    g = s.spec.grpo
    submit = submit or submit_train_prompts(s, step)
    return collect_rollouts(s, step, reporter, lambda round, n: submit(round, n)(), first=first,
                            units=g.prompts_per_step, group_size=g.num_generations)


@dataclass(frozen=True)
class Ahead:
    """A step's training draws, submitted a step early."""

    step: int
    submit: Submit[Example]  # its draws: round 0 is in flight, refills come from here
    first: Sampling[Example]  # round 0


@dataclass
class TrainRollouts:
    """A job's training rollouts, step after step (collect_train_rollouts).

    With rollout.max_staleness 1, once step k's rollouts are collected (sampled, scored) step k+1's
    first round is submitted to the engine, so it samples them with step k's weights while step k
    trains: one update behind when step k+1 trains on them. Refill rounds are sampled when needed,
    with the weights of their step. A resumed attempt's first step samples with its own weights.
    """

    s: Setup
    ahead: Ahead | None = None

    def collect(self, step: int, reporter: Reporter) -> Rollouts[Example] | None:
        s, g, ahead = self.s, self.s.spec.grpo, self.ahead
        self.ahead = None
        if ahead is not None and ahead.step == step:
            ro = collect_train_rollouts(s, step, reporter, submit=ahead.submit, first=ahead.first)
        else:
            ro = collect_train_rollouts(s, step, reporter)
        if s.spec.rollout.max_staleness and step < g.steps:
            submit = submit_train_prompts(s, step + 1)
            self.ahead = Ahead(step + 1, submit, submit(0, g.prompts_per_step))
        return ro
