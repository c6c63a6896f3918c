"""A multi-turn environment a job's episodes run in: an OpenEnv server (reset/step over a WebSocket
session, the reward its own), named by URL or bundled with the worker.

A job with `environment:` samples episodes instead of single completions: each of a step's
`grpo.prompts_per_step` units is one reset seed, its group `grpo.num_generations` episodes from that
seed; an episode's reward is the environment's. `grpo.max_new_tokens` and `grpo.stop` bound each turn.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from service.core.grader_urls import UrlRefused, parse_url
from service.core.spec_base import _Section

# Environments the worker serves itself on loopback (worker/environments/bundled).
BUNDLED_ENVIRONMENTS = ("calculator", "multiplication", "guess-number")


class ToolSpec(_Section):
    """A tool the model may call, declared for a server that reads calls from the model's text."""

    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$",
                      description="The name the model calls it by.")
    description: str = Field("", max_length=2000, description="What it does, as the model reads it.")
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}},
                                       description="Its arguments' JSON schema (an object schema, at most 16 KB).")

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        if v.get("type", "object") != "object":
            raise ValueError("parameters must be a JSON schema of type 'object'")
        if len(json.dumps(v)) > 16_384:
            raise ValueError("parameters is larger than 16 KB of JSON")
        return v


class TaskSplits(_Section):
    """The Task API's splits a job draws from (a server made with openenv 0.10 or later that has one)."""

    train: str = Field("train", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                       description="The split whose tasks the training steps draw.")
    eval: str = Field("test", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                      description="The split whose first `eval_episodes` tasks evaluation plays.")


class EnvironmentSpec(_Section):
    kind: Literal["openenv"] = Field("openenv", description="The protocol: an OpenEnv server (WebSocket `/ws`: "
                                     "reset, step, state, close).")
    name: Literal["calculator", "multiplication", "guess-number"] | None = Field(
        None, description="A bundled environment the worker runs on loopback: `calculator` (word problems with a "
        "calculator tool, rewarded on the final answer), `multiplication` (products too long to work out in one's "
        "head, with the same tool), or `guess-number` (find a number from higher/lower feedback, rewarded per "
        "turn). The calculator tool is an MCP tool (`tools: mcp`) and, for a model without tools, "
        "`<calc>expression</calc>` in text. Exactly one of `name` and `url`.")
    url: str | None = Field(None, max_length=2048, description="The base URL (http or https) of an OpenEnv server "
                            "on the admin's allow-list (GRPO_ENVIRONMENT_URLS); the worker opens `<url>/ws`.")
    max_turns: int = Field(4, ge=1, le=64, description="Model turns per episode; an episode still running after "
                           "them is truncated (its reward is what it earned so far).")
    max_episode_tokens: int = Field(512, ge=16, le=32768, description="Tokens after the first prompt an episode "
                                    "may hold (the model's and the observations'); a turn that would pass it "
                                    "ends the episode, truncated.")
    max_observation_tokens: int = Field(256, ge=1, le=8192, description="An observation longer than this many "
                                        "tokens is cut to it (and counted in `env/observations_cut`).")
    max_concurrent: int = Field(16, ge=1, le=1024, description="Sessions open at once on the server, at most: "
                                "an episode that ends frees its session for the next. A server with fewer slots "
                                "(its `max_concurrent_envs`) plays the rest as its sessions free.")
    timeout_s: float = Field(30.0, gt=0.0, le=600.0, description="Seconds a reset or step may take; past it the "
                             "episode ends with an error.")
    reward: Literal["sum", "last"] = Field("sum", description="An episode's reward: the sum of its turns' rewards, "
                                           "or the last turn's.")
    on_error: Literal["zero", "drop_group"] = Field(
        "zero", description="An episode the environment failed (timed out, errored, closed the session): reward "
        "0 and trained as sampled (`zero`), or its whole group left out of the step (`drop_group`).")
    action_field: str = Field("message", min_length=1, max_length=64, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                              description="The action's field that carries the model's text.")
    observation_field: str = Field("message", min_length=1, max_length=64, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                   description="The observation's field whose text the model reads next.")
    tools: Literal["mcp"] | Annotated[list[ToolSpec], Field(min_length=1, max_length=32)] | None = Field(
        None, description="Tools the model is shown (in its chat template's `tools` format) and may call as "
        "`<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>`. `mcp`: the server's MCP tools, listed "
        "when the job starts; each call is made as an MCP `tools/call` in the episode's session and its result "
        "read back as a `tool` message; a turn without a call is the model's answer (a text action). A list: "
        "tools declared here for a server that reads the calls from the model's text; its answer to a turn with "
        "calls is read back as a `tool` message. Unset: no tools, the model's text is the action.")
    tasks: TaskSplits | None = Field(
        None, description="Draw episodes among the server's tasks by split and index (OpenEnv's Task API: "
        "`reset(split, index)`) instead of reset seeds: training from `train`, evaluation from the first "
        "`eval_episodes` of `eval`. The server must have the API, and tasks in both splits.")
    eval_episodes: int = Field(16, ge=1, le=10_000, description="Greedy episodes per evaluation, from reset seeds "
                               "no training step draws.")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            return str(parse_url(v))
        except UrlRefused as exc:
            raise ValueError(f"url {exc}") from None

    @model_validator(mode="after")
    def _one_source(self) -> EnvironmentSpec:
        if (self.name is None) == (self.url is None):
            raise ValueError("environment: give exactly one of `name` (a bundled environment: "
                             f"{', '.join(BUNDLED_ENVIRONMENTS)}) and `url` (an OpenEnv server)")
        return self
