"""What bounds a job's episodes and the worker's exposure to its environment."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """What bounds an episode and the worker's exposure to the environment (the job's spec and the admin's cap)."""

    max_turns: int
    max_episode_tokens: int
    max_observation_tokens: int
    max_concurrent: int
    timeout_s: float
    max_bytes: int
    action_field: str = "message"
    observation_field: str = "message"
