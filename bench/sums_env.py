"""bench/selection.py's sums as an OpenEnv environment with the Task API, for its `--environment` study.

A task is one row of the study's files (`train.jsonl`, `val.jsonl`, `test.jsonl` in --data: {"prompt": "3+8+1",
"answer": "12"}), split by file and indexed by line, so a job with `environment.tasks` draws its episodes
among the training rows and a unit of `selection.prompts` is one of them. An episode has up to two turns:

- the reset's observation is the row's question as the study's jsonl prompt renders it
  ("Question: 3+8+1\\nAnswer:"); the model's turn is its answer, read as the last integer it wrote;
- right: reward 1, and the episode ends; wrong on the first turn: reward 0, and the model is told so and
  asked again ("Wrong.\\nQuestion: 3+8+1\\nAnswer:"); right then: reward 0.5 (the episode's reward is the
  sum of its turns').

It needs OpenEnv's current release (the Task API is openenv 0.10's: `make openenv`), so it runs in
.venv-openenv, with no torch (so it reads answers itself: worker.rewards imports torch):

    .venv-openenv/bin/python bench/sums_env.py --data /tmp/selection-episodes/data --port 8013
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from uuid import uuid4

ROOT = Path(__file__).resolve().parents[1]
SPLITS = ("train", "val", "test")
_INT = re.compile(r"-?\d+")


def question(q: str) -> str:
    """The study's jsonl prompt of a question: render_prompt with no instruction and no template."""
    from worker.datasets import render_prompt  # torch-free: it imports in .venv-openenv

    return render_prompt(None, q, "", chat=False)


def answered(text: str, answer: str) -> bool:
    """The last integer of the model's turn is the answer (what numeric_match reads of these answers)."""
    found = _INT.findall(text)
    return bool(found) and int(found[-1]) == int(answer)


def make_app(data: Path, max_sessions: int):
    sys.modules.setdefault("gradio", None)  # type: ignore[arg-type]  # no web UI (its import takes ~10 s)
    sys.path.insert(0, str(ROOT))
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import State

    from worker.environments.bundled import TextAction, TextObservation

    rows = {s: [json.loads(x) for x in (data / f"{s}.jsonl").read_text().splitlines()] for s in SPLITS
            if (data / f"{s}.jsonl").exists()}

    class SumsEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self._state = State(episode_id=str(uuid4()), step_count=0)
            self._row: dict = {}

        def list_splits(self) -> list[str]:
            return list(rows)

        def num_tasks(self, split: str) -> int:
            if split not in rows:
                raise NotImplementedError(f"no split {split!r}")
            return len(rows[split])

        def get_task(self, split: str, index: int) -> dict:
            if not 0 <= index < self.num_tasks(split):
                raise IndexError(index)
            return {"id": f"{split}-{index}", "index": index, "prompt": question(rows[split][index]["prompt"])}

        def reset(self, seed: int | None = None, episode_id: str | None = None, split: str | None = None,
                  index: int | None = None, **kwargs) -> TextObservation:
            self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
            if split is None or index is None:  # a reset seed: a training row
                split, index = "train", (seed or 0) % len(rows["train"])
            self.get_task(split, index)
            self._row = rows[split][index]
            return TextObservation(message=question(self._row["prompt"]), reward=None, done=False)

        def step(self, action: TextAction, timeout_s: float | None = None, **kwargs) -> TextObservation:  # type: ignore[override]
            self._state.step_count += 1
            first = self._state.step_count == 1
            if answered(action.message, self._row["answer"]):
                return TextObservation(message="Right.", reward=1.0 if first else 0.5, done=True)
            if first:
                return TextObservation(message="Wrong.\n" + question(self._row["prompt"]), reward=0.0)
            return TextObservation(message="Wrong.", reward=0.0, done=True)

        @property
        def state(self) -> State:
            return self._state

    return create_app(SumsEnvironment, TextAction, TextObservation, env_name="sums", max_concurrent_envs=max_sessions)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="the folder of train.jsonl, val.jsonl, test.jsonl")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--max-sessions", type=int, default=256)
    args = ap.parse_args()
    import uvicorn

    uvicorn.run(make_app(args.data, args.max_sessions), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
