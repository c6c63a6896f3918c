"""OpenEnv's Task API (openenv 0.10): a server that names its tasks by split and index.

Such a server lists its environment at `GET /list_environments` and counts a split's tasks at
`POST /{env}/num_tasks` (`{"split": ...}`); an episode is reset to a task with `reset(split, index)`.
A job with `environment.tasks` draws its training episodes among the `train` split's indices and
evaluates on the first of the `eval` split's, where a server without the API draws reset seeds.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from service.core.specs.environment import TaskSplits
from worker.environments.client import EnvironmentFailed


@dataclass(frozen=True)
class TaskSet:
    """The splits a job draws from, and how many tasks each holds."""

    train: str
    eval: str
    train_tasks: int
    eval_tasks: int


def count_tasks(url: str, splits: TaskSplits, *, timeout_s: float) -> TaskSet:
    """The server's task counts for the job's splits; EnvironmentFailed (saying what the server answered)
    when it has no Task API, no such split, or no task in one."""
    base = url.rstrip("/")
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False) as http:
            listed = http.get(f"{base}/list_environments")
            if listed.status_code != 200:
                raise EnvironmentFailed(f"environment.tasks: the server has no Task API (GET /list_environments "
                                        f"answered {listed.status_code}); it needs openenv 0.10 or later")
            names = listed.json()
            if not isinstance(names, list) or not names or not isinstance(names[0], str):
                raise EnvironmentFailed("environment.tasks: GET /list_environments did not answer a list of names")
            counts = {}
            for split in (splits.train, splits.eval):
                r = http.post(f"{base}/{names[0]}/num_tasks", json={"split": split})
                answer = r.json() if r.status_code == 200 else None
                n = answer.get("num_tasks") if isinstance(answer, dict) else None
                if not isinstance(n, int) or n < 1:
                    raise EnvironmentFailed(f"environment.tasks: the server holds no task in split {split!r} "
                                            f"({r.status_code}: {r.text[:200]})")
                counts[split] = n
    except (httpx.HTTPError, ValueError) as exc:
        raise EnvironmentFailed(f"environment.tasks: the server's Task API failed: {exc}") from None
    return TaskSet(train=splits.train, eval=splits.eval, train_tasks=counts[splits.train],
                   eval_tasks=counts[splits.eval])
