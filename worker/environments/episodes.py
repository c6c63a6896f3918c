"""An episode as the ids it was sampled as, and the training rows built from them.

An episode holds the first prompt's ids and, in order, segments of ids: the model's (sampled, with
the engine's log-probs where it gives them) and the environment's (the tokens around each
observation). Its training row is the prompt and every segment concatenated; the loss mask is 1 on
the model's tokens only. Nothing here decodes or encodes: ids in, ids out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.batch import RolloutBatch, left_padded


class TokenMismatch(RuntimeError):
    """The ids a turn was sampled from are not the episode's ids so far: training on them would train
    on tokens the model never saw."""


@dataclass(frozen=True)
class Segment:
    ids: tuple[int, ...]
    sampled: bool  # the model's tokens (trained) or the environment's (context only)
    logprobs: tuple[float, ...] | None = None  # the engine's, one per id, where it gives them (vllm)


@dataclass(frozen=True)
class Turn:
    """One model turn and the environment's answer to it, as text, for the record."""

    action: str
    observation: str | None  # None: the episode ended at this turn without one (or the environment failed)
    reward: float | None
    tool_calls: int = 0  # tool calls the turn made (or the environment counted)
    tool_errors: int = 0  # ... that failed
    malformed_calls: int = 0  # `<tool_call>` blocks that could not be read


@dataclass
class Episode:
    """One episode's ids and record; `seed` is its reset seed, `g` its index in the group."""

    seed: int
    g: int
    prompt_ids: list[int]
    first_observation: str
    segments: list[Segment] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    done: bool = False  # the environment said so
    truncated: bool = False  # max_turns or max_episode_tokens ended it first
    error: str | None = None  # the environment failed it: why
    observations_cut: int = 0
    split: str | None = None  # the Task API's split whose task `seed` indexes (None: `seed` is a reset seed)

    @property
    def ids(self) -> list[int]:
        """The ids so far after the prompt: what the next turn continues from."""
        return [t for s in self.segments for t in s.ids]

    @property
    def context(self) -> list[int]:
        """Prompt and every segment: exactly what the next turn must be sampled from."""
        return self.prompt_ids + self.ids

    @property
    def live(self) -> bool:
        return not (self.done or self.truncated or self.error is not None)

    def check_sampled_from(self, engine_prompt: list[int]) -> None:
        """TokenMismatch unless the engine sampled this turn from exactly the episode's ids."""
        if engine_prompt != self.context:
            at = next((i for i, (a, b) in enumerate(zip(engine_prompt, self.context)) if a != b),
                      min(len(engine_prompt), len(self.context)))
            raise TokenMismatch(f"episode (seed {self.seed}, #{self.g}) turn {len(self.turns) + 1} was sampled from "
                                f"{len(engine_prompt)} ids that differ from its {len(self.context)} at position {at}")

    def reward(self, how: str) -> float:
        """The episode's reward: the sum of its turns' or the last turn's (0 where none was given)."""
        given = [t.reward for t in self.turns if t.reward is not None]
        if not given:
            return 0.0
        return float(sum(given)) if how == "sum" else float(given[-1])


def rows(episodes: list[Episode], pad_id: int, *, device: torch.device | str = "cpu") -> RolloutBatch:
    """The training rows [N] of `episodes`: prompts left-padded, every segment after them right-padded,
    the trained mask 1 on sampled ids only, the engine's log-probs where every sampled segment has them."""
    N = len(episodes)
    T = max((len(e.ids) for e in episodes), default=0)
    prompt_ids, prompt_mask = left_padded([e.prompt_ids for e in episodes], pad_id)  # [N, P]
    completion_ids = torch.full((N, T), pad_id, dtype=torch.long)
    completion_mask = torch.zeros(N, T, dtype=torch.long)
    trained = torch.zeros(N, T, dtype=torch.long)
    with_logp = all(s.logprobs is not None for e in episodes for s in e.segments if s.sampled)
    sampler_logp = torch.zeros(N, T) if with_logp else None
    for i, e in enumerate(episodes):
        at = 0
        for s in e.segments:
            n = len(s.ids)
            if n:
                completion_ids[i, at:at + n] = torch.tensor(s.ids)
                completion_mask[i, at:at + n] = 1
                if s.sampled:
                    trained[i, at:at + n] = 1
                    if sampler_logp is not None:
                        sampler_logp[i, at:at + n] = torch.tensor(s.logprobs)
            at += n
    batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                         completion_mask=completion_mask, truncated=torch.tensor([e.truncated for e in episodes],
                                                                                 dtype=torch.bool),
                         completions=[transcript(e) for e in episodes], sampler_logp=sampler_logp,
                         trained_mask=trained)
    check_rows(batch, episodes)
    return batch.to(device)


def check_rows(batch: RolloutBatch, episodes: list[Episode]) -> None:
    """TokenMismatch unless every row's trained ids are, in order, exactly its episode's sampled ids."""
    assert batch.trained_mask is not None
    for i, e in enumerate(episodes):
        trained = batch.completion_ids[i][batch.trained_mask[i].bool()].tolist()
        sampled = [t for s in e.segments if s.sampled for t in s.ids]
        if trained != sampled:
            raise TokenMismatch(f"episode (seed {e.seed}, #{e.g}): its training row holds {len(trained)} trained ids "
                                f"that are not the {len(sampled)} it sampled")


def transcript(e: Episode) -> str:
    """The episode as text, turn by turn: what a sample row shows as its completion."""
    parts = []
    for t in e.turns:
        parts.append(t.action)
        if t.observation is not None:
            parts.append(f"[env] {t.observation}")
    if e.error is not None:
        parts.append(f"[env error] {e.error}")
    return "\n".join(parts)


def record(e: Episode) -> dict:
    """The episode for its sample row's record (JSON): how it ended and its turns, as text."""
    return {"seed": e.seed, "done": e.done, "truncated": e.truncated, "error": e.error,
            "first_observation": e.first_observation,
            "tokens": {"prompt": len(e.prompt_ids), "sampled": sum(len(s.ids) for s in e.segments if s.sampled),
                       "environment": sum(len(s.ids) for s in e.segments if not s.sampled)},
            "turns": [{"action": t.action, "observation": t.observation, "reward": t.reward,
                       "tool_call": t.tool_calls > 0, "tool_error": t.tool_errors > 0, "tool_calls": t.tool_calls,
                       "malformed_calls": t.malformed_calls, **trained} for t, trained in zip(e.turns, _turn_tokens(e))]}


def _turn_tokens(e: Episode) -> list[dict[str, int]]:
    """Per turn: the tokens the model sampled (trained) and the environment's that followed (not trained)."""
    out: list[dict[str, int]] = []
    for s in e.segments:
        if s.sampled:
            out.append({"trained_tokens": len(s.ids), "environment_tokens": 0})
        elif out:
            out[-1]["environment_tokens"] += len(s.ids)
    return out
