"""Where a step's groups come from: prompts of a split, or episodes of the job's environment.

Each source draws its units with a prompt draw (worker/loops/draws.py), samples them and hands back a
`Drawn`: prompts are sampled by the engine (one group of G completions each, seeded by (tag, round,
unit)); an environment's reset seeds are played as groups of G episodes, scheduled by the environment's
episode scheduler (worker/environments/runner.py), and come back already scored. `TrainRollouts` collects
a job's training rollouts step after step, a step ahead where `rollout.max_staleness` is 1.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from service.core import tracing
from worker.datasets import Example, render_example
from worker.environments import episodes as episode_rows
from worker.environments.runner import EpisodeStats, play
from worker.loops.draws import PromptDraw, Uniform, draw_share, pick
from worker.loops.rollouts import Draw, Drawn, Rollouts, Sampling, Submit, Tied, collect_rollouts
from worker.loops.scoring import episode_scores
from worker.loops.setup import AnySpec, RLJob, Setup
from worker.parallel.distributed import SINGLE, row_seed
from worker.reporting import Records


def prompt_for(s: Setup[AnySpec], ex: Example) -> str:
    return render_example(s.tokenizer, ex, s.task.instruction, chat=s.spec.dataset.chat_template)


def submit_prompts(s: Setup[RLJob], pool: list[Example], G: int, *, seed_tag: str,
                   prompts: PromptDraw | None = None) -> Submit[Example]:
    """Units are prompts of `pool`, drawn by `prompts` (uniform by default) with a generator seeded by
    `seed_tag`; one group each, sampled with seeds from (seed_tag, round, unit)."""
    rng, draw = random.Random(seed_tag), prompts or Uniform(len(pool))

    def submit(round: int, n: int) -> Sampling[Example]:
        share = draw_share(draw, rng, n, s.ranks)
        examples = pick(pool, share)
        texts = [prompt_for(s, ex) for ex in examples]
        sampled = s.engine.submit(texts, G, seeds=[row_seed(seed_tag, round, i) for i in share.index])
        return lambda: Drawn(batch=sampled(), examples=examples, prompts=texts, units=examples,
                             keys=[(round, i) for i in share.index], picked=share.picked, drawn_by=draw)

    return submit


def submit_episodes(s: Setup[RLJob], G: int, *, seed_tag: str, validation: bool = False,
                    step: int | None = None, prompts: PromptDraw | None = None) -> Submit[Example]:
    """Units are reset seeds (or Task API tasks) of the job's environment (drawn with `seed_tag`;
    `validation`: among its evaluation ones), a group of G episodes each, played now; each turn sampled with a seed from
    (seed_tag, round, episode, turn). `step`: training step `step`'s, tallied for its health reading."""
    rng, env = random.Random(seed_tag), s.environment
    assert env is not None
    units = env.evaluation_units() if validation else env.training_units()
    draw = prompts or Uniform(units.count, offset=units.first)

    def submit(round: int, n: int) -> Sampling[Example]:
        share = draw_share(draw, rng, n, SINGLE)  # every rank plays every episode of the step
        seeds = share.picked
        with tracing.span("rl.episodes", **{"grpo_jobs.round": round}):
            episodes, played = play(env.players, env.url, seeds, G, env.limits, scheduler=env.scheduler,
                                    seed_of=lambda i, turn: row_seed(seed_tag, round, i, turn), stop=env.stop,
                                    split=units.split)
        stats = EpisodeStats.of(episodes, played)
        if step is not None:
            env.tally.add(step, stats)
        batch = episode_rows.rows(episodes, s.tokenizer.pad_token_id)
        firsts = [Example(question=episodes[i * G].first_observation, answers=(), meta={"seed": seed})
                  for i, seed in enumerate(seeds)]
        drawn = Drawn(batch=batch, examples=firsts, prompts=[ex.question for ex in firsts], units=firsts,
                      keys=[(round, i) for i in range(n)], scored=episode_scores(env.spec, episodes, G),
                      episodes=episodes, stats=stats, picked=seeds, drawn_by=draw)
        return lambda: drawn

    return submit


def draw_prompts(s: Setup[RLJob], pool: list[Example], G: int, *, seed_tag: str) -> Draw[Example]:
    """submit_prompts, waiting for each draw's completions."""
    submit = submit_prompts(s, pool, G, seed_tag=seed_tag)
    return lambda round, n: submit(round, n)()


def draw_validation(s: Setup[RLJob], G: int, *, seed_tag: str) -> Draw[Example]:
    """Groups from the validation split: its prompts, or an environment's evaluation seeds."""
    if s.environment is not None:
        submit = submit_episodes(s, G, seed_tag=seed_tag, validation=True)
        return lambda round, n: submit(round, n)()
    return draw_prompts(s, s.task.val, G, seed_tag=seed_tag)


def submit_train_prompts(s: Setup[RLJob], step: int) -> Submit[Example]:
    """The draws of step `step`'s training prompts."""
    g = s.spec.grpo
    tag = f"prompts-train-{g.seed}-{step}"
    if s.environment is not None:
        return submit_episodes(s, g.num_generations, seed_tag=tag, step=step, prompts=s.prompt_draw)
    return submit_prompts(s, s.task.train, g.num_generations, seed_tag=tag, prompts=s.prompt_draw)


def collect_train_rollouts(s: Setup[RLJob], step: int, reporter: Records, *, submit: Submit[Example] | None = None,
                           first: Sampling[Example] | None = None) -> Rollouts[Example] | Tied:
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

    s: Setup[RLJob]
    ahead: Ahead | None = None

    def collect(self, step: int, reporter: Records) -> Rollouts[Example] | Tied:
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
