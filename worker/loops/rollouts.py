"""A step's rollouts: draw units, sample and score their groups, assemble the batch the update trains on.

Every kind samples in *units* that each yield groups of G completions: a prompt is one unit of one
group (GRPO, TracIn); a joint query is one unit of k groups, one per retrieved document; an environment's
reset seed is one unit of one group of G episodes. The three stages, each readable alone:

1. draw: which units (the prompt draw, worker/loops/draws.py), and their sampling (a source,
   worker/loops/sources.py, or the joint loop's retrieval): a `Draw` gives one round's `Drawn`;
2. sample and score (`sample_rounds`): rounds of draws, scored (worker/loops/scoring.py) and told to the
   prompt draw; a unit whose groups' rewards all tie carries no signal and, with
   `grpo.drop_zero_std_groups`, is dropped and replaced by a fresh one, up to `grpo.max_refill_rounds`
   extra rounds;
3. assemble (`assemble`): the kept units' rows as one `Rollouts`, with group-normalised advantages and
   the loss mask; a tied group inside a kept unit stays in the batch (the joint retriever needs its reward)
   but is left out of training.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Generic, TypeVar

import torch

from service.core import tracing
from service.core.records import SampleRow
from worker.algos.advantages import group_advantages, zero_std_groups
from worker.batch import RolloutBatch
from worker.datasets import Example
from worker.environments import episodes as episode_rows
from worker.environments.episodes import Episode
from worker.environments.runner import EpisodeStats
from worker.loops.draws import PromptDraw
from worker.loops.scoring import GroupRewards, score_groups
from worker.loops.setup import RLJob, Setup
from worker.parallel.distributed import SINGLE, Ranks
from worker.reporting import Records

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
    picked: list[int] | None = None  # [n_units] each unit's index in its pool, as the prompt draw drew it
    drawn_by: PromptDraw | None = None  # the prompt draw that chose the units: told their rewards


Draw = Callable[[int, int], Drawn[U]]  # (round, n_units on every rank) -> this rank's share, sampled
Sampling = Callable[[], Drawn[U]]  # a draw whose completions the engine is still sampling: waits, gives it
Submit = Callable[[int, int], Sampling[U]]  # a Draw that returns as soon as the sampling has started


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
    spent: Spent | None = None  # what the step's rounds sampled, and what its draw expected

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
        if self.spent is not None:
            sums |= self.spent.sums()
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
        if self.spent is not None:
            m |= self.spent.metrics(t, frac_zero_std=self.frac_zero_std)
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

    drawn: Drawn[Any]
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


def grade(s: Setup[RLJob], d: Drawn[U], G: int, step: int) -> GroupRewards:
    """A draw's rewards: the environment's that came with it, or the job's reward functions'."""
    if d.scored is not None:
        return d.scored
    with tracing.span("rl.reward", **{"grpo_jobs.completions": len(d.batch)}):
        return score_groups(s, d.batch.completions, d.examples, G, step)


def _sample_round(draw: Draw[U], round: int, need: int, G: int, *, first: Sampling[U] | None) -> Drawn[U]:
    """One sampling round (`first`: its draw submitted earlier), checked for a group of G per prompt."""
    with tracing.span("rl.sample", **{"grpo_jobs.round": round}):
        d = first() if first is not None else draw(round, need)
    if len(d.batch) != len(d.prompts) * G or len(d.prompts) != len(d.units) * d.groups_per_unit:
        raise RuntimeError(f"the sampler returned {len(d.batch)} completions for {len(d.prompts)} groups of "
                           f"{G} from {len(d.units)} units; expected {len(d.units) * d.groups_per_unit * G}")
    return d


@dataclass
class Spent:
    """What a step's sampling rounds cost (this rank's rows), and what its draw expected of them."""

    rollouts: int = 0  # completions (or episodes) sampled, every round
    tokens: float = 0.0  # the tokens they generated (an episode's: the model's own, not the observations between)
    refill_rollouts: int = 0  # ... of them in refill rounds (grpo.drop_zero_std_groups)
    predicted: float | None = None  # the draw's predicted share of round 0's groups with a signal

    def add(self, batch: RolloutBatch, *, refill: bool) -> None:
        self.rollouts += len(batch)
        self.tokens += float(batch.loss_mask().sum())
        self.refill_rollouts += len(batch) if refill else 0

    def sums(self) -> dict[str, float]:
        """This rank's part, to be summed over ranks."""
        return {"spent": float(self.rollouts), "spent_tokens": self.tokens, "refilled": float(self.refill_rollouts)}

    def metrics(self, t: dict[str, float], *, frac_zero_std: float) -> dict[str, float]:
        """The step's sampling cost on the axes a selection is judged on, from `sums()` summed over ranks."""
        m = {"selection/observed_signal": 1.0 - frac_zero_std, "selection/rollouts": t["spent"],
             "selection/generated_tokens": t["spent_tokens"], "selection/refill_rollouts": t["refilled"]}
        if self.predicted is not None:
            m["selection/predicted_signal"] = self.predicted
        return m


@dataclass(frozen=True)
class Tied:
    """A step whose every group tied, refills included: nothing to train on, but its rollouts were paid for
    and its episodes played, and the skipped step reports both."""

    spent: Spent  # this rank's
    played: EpisodeStats | None  # its episodes, as Rollouts.episode_stats (a job with an environment)
    ranks: Ranks

    def metrics(self) -> dict[str, float]:
        m = {"frac_reward_zero_std": 1.0, **self.spent.metrics(self.ranks.sum(self.spent.sums()), frac_zero_std=1.0)}
        return m | (self.played.metrics() if self.played is not None else {})


@dataclass
class Rounds:
    """What the sampling rounds of a step kept, and what they cost."""

    kept: list[_Scored]  # each round's kept units (this rank's), in order
    frac_zero_std: float  # tied groups among the first round's (every rank's)
    rounds: int  # generate calls, the first included
    reward_s: float  # wall time spent scoring, every round
    played: list[EpisodeStats] = field(default_factory=list)  # every round's episodes (a job with an environment)
    spent: Spent = field(default_factory=Spent)  # what the rounds sampled (this rank's)


def sample_rounds(s: Setup[RLJob], step: int, draw: Draw[U], *, units: int, G: int, drop: bool,
                  first: Sampling[U] | None) -> Rounds:
    """Rounds of `draw`, scored, until `units` units with signal are kept (every unit, without `drop`) or
    grpo.max_refill_rounds refills are spent; `kept` is empty on every rank when no rank kept any."""
    out = Rounds(kept=[], frac_zero_std=0.0, rounds=0, reward_s=0.0)
    need = units  # the same on every rank: each round draws and keeps over all of them
    while need > 0:
        d = _sample_round(draw, out.rounds, need, G, first=first if out.rounds == 0 else None)
        out.played.extend([d.stats] if d.stats is not None else [])
        graded = grade(s, d, G, step)
        out.reward_s += graded.scored.seconds
        out.spent.add(d.batch, refill=out.rounds > 0)
        if d.drawn_by is not None and d.picked is not None:
            if out.rounds == 0:  # what the draw expected of the step's groups, before it sees them
                out.spent.predicted = d.drawn_by.predicted(d.picked)
            d.drawn_by.observe(d.picked, graded.rewards.view(len(d.units), d.groups_per_unit * G))
        tied = zero_std_groups(graded.rewards, G)  # [n_groups]
        keep = ~tied.view(-1, d.groups_per_unit).all(1) if drop else torch.ones(len(d.units), dtype=torch.bool)
        counts = s.ranks.sum({"tied": float(tied.sum()), "groups": len(tied), "kept": float(keep.sum())})
        if out.rounds == 0:
            out.frac_zero_std = counts["tied"] / max(counts["groups"], 1.0)
        last = _Scored(d, graded.rewards, graded.excluded, graded.scored.per_fn)
        if keep.any():
            out.kept.append(last.keep_units(keep, G))
        need -= int(counts["kept"])
        out.rounds += 1
        if need > 0 and out.rounds > s.spec.grpo.max_refill_rounds:
            break
    if need == units:  # nothing kept on any rank
        return out
    if not out.kept:  # this rank kept nothing; the others did: an empty part, shaped as the last round's
        out.kept.append(last.keep_units(torch.zeros(len(last.drawn.units), dtype=torch.bool), G))
    return out


def assemble(s: Setup[RLJob], step: int, reporter: Records, r: Rounds, G: int, *, drop: bool) -> Rollouts[Any]:
    """The kept units' rows as one step's rollouts: group-normalised advantages, the loss mask (an
    environment's tokens, truncated completions where asked, and excluded rows masked) and the rows that
    train (tied groups left out when dropping)."""
    g, kept = s.spec.grpo, r.kept
    batch = RolloutBatch.cat([k.drawn.batch for k in kept], s.tokenizer.pad_token_id)
    rewards = torch.cat([k.rewards for k in kept])  # [N]
    excluded = torch.cat([k.excluded for k in kept])  # [N]
    adv = group_advantages(rewards, G, normalize=g.normalize_advantages, eps=g.advantage_eps)  # [N]
    grouped_adv = adv.view(-1, G)  # [n_groups, G]
    if not torch.allclose(grouped_adv.mean(dim=1), torch.zeros(len(grouped_adv)), atol=1e-4):
        raise RuntimeError(f"step {step}: group advantages are not centred (rewards {rewards.view(-1, G)[:3].tolist()})")
    loss_mask = batch.loss_mask().clone()  # an episode's environment tokens are context, never trained
    if g.mask_truncated_completions:
        loss_mask[batch.truncated] = 0
    loss_mask[excluded] = 0
    tied = zero_std_groups(rewards, G)  # [n_groups]
    train_rows = torch.arange(len(batch)).view(-1, G)[~tied].reshape(-1).tolist() if drop else list(range(len(batch)))
    reporter.event("groups", f"first groups of step {step}", level="debug", data={
        "rewards": rewards.view(-1, G)[:3].tolist(), "advantages": grouped_adv[:3].tolist()})
    first = kept[0].drawn
    keys = [(*key, j, g) for k in kept for key in k.drawn.keys for j in range(k.drawn.groups_per_unit) for g in range(G)]
    stale = None if batch.version is None else (s.engine.version - batch.version).float().cpu()
    return Rollouts(batch=batch, examples=[ex for k in kept for ex in k.drawn.examples],
                    prompts=[p for k in kept for p in k.drawn.prompts], units=[u for k in kept for u in k.drawn.units],
                    groups_per_unit=first.groups_per_unit, group_size=G, rewards=rewards, advantages=adv,
                    loss_mask=loss_mask, per_fn={name: [v for k in kept for v in k.per_fn[name]] for name in kept[0].per_fn},
                    train_rows=train_rows, frac_zero_std=r.frac_zero_std, refill_rounds=r.rounds - 1,
                    reward_s=r.reward_s, keys=keys, staleness=stale, ranks=s.ranks, excluded=excluded,
                    episodes=None if first.episodes is None else [e for k in kept for e in k.drawn.episodes or []],
                    episode_stats=EpisodeStats.total(r.played), spent=r.spent)


def collect_rollouts(s: Setup[RLJob], step: int, reporter: Records, draw: Draw[U], *, units: int, group_size: int,
                     drop_zero_std: bool | None = None, first: Sampling[U] | None = None) -> Rollouts[U] | Tied:
    """`units` units' groups, scored, with group-normalised advantages; Tied when every unit tied.

    With dropping (default: grpo.drop_zero_std_groups), tied units are replaced by fresh ones for
    up to grpo.max_refill_rounds more rounds, and tied groups of kept units are left out of training.
    `first`: round 0's draw of all `units`, submitted earlier (max_staleness 1).
    """
    drop = s.spec.grpo.drop_zero_std_groups if drop_zero_std is None else drop_zero_std
    rounds = sample_rounds(s, step, draw, units=units, G=group_size, drop=drop, first=first)
    if not rounds.kept:
        return Tied(rounds.spent, EpisodeStats.total(rounds.played), s.ranks)
    return assemble(s, step, reporter, rounds, group_size, drop=drop)
