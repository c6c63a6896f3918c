"""What a session run holds between operations (worker.session.run runs them, worker.session.sampling
samples from it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from worker.model.checkpoints import Trainables


@dataclass
class Session:
    """What a run holds between operations."""

    model: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.AdamW
    params: list[torch.nn.Parameter]
    vocab_size: int
    context: int | None = None  # the model's longest sequence (max_position_embeddings), when it has one
    step: int = 0  # optim_steps taken: the run's step
    version: int = 0  # changes with the weights (optim_step, load_weights): what a sampling snapshot names;
    # saved with the state, so it goes on across idle releases
    # weights to sample from: "v<version>" (save_weights_for_sampler) or "s<step>" (a saved checkpoint)
    snapshots: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    saved_step: int | None = None  # the step of the last saved state
    trains: bool = True  # False: a base model's sampler (create_sampling_session), with nothing to save
    pending: dict[str, float] = field(default_factory=lambda: {"loss": 0.0, "tokens": 0.0})
    step_started: float = field(default_factory=time.monotonic)

    def trainables(self) -> Trainables:
        return Trainables(model=self.model, tokenizer=self.tokenizer, optimizers={"policy": self.optimizer},
                          schedulers={})
