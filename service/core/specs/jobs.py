"""A whole job spec per kind, discriminated on `kind`, and every rule across its sections; the spec of a
tinker session run; a job's statuses."""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Literal, get_args

from pydantic import Field, TypeAdapter, model_validator

from service.core.health import HealthSpec
from service.core.reward_specs import FunctionReward, RewardSpec
from service.core.spec_base import _Section, reject_unused
from service.core.specs.data import DEFAULT_REWARDS, DatasetSpec
from service.core.specs.environment import EnvironmentSpec
from service.core.specs.extras import RetrieverSpec, SelectionSpec, SparsitySpec, TracInSpec
from service.core.specs.model import ModelSpec
from service.core.specs.runtime import DevicesSpec, ResourcesSpec, RolloutSpec, gpus_needed
from service.core.specs.training import GRPOSpec, SFTSpec, TrainSpec


class _JobBase(_Section):
    if TYPE_CHECKING:  # each kind's own Literal field, the union's tag
        kind: str
    name: str | None = Field(None, max_length=200, description="Free-text label shown in lists and the dashboard.")
    model: ModelSpec = Field(default_factory=ModelSpec)
    dataset: DatasetSpec = Field(default_factory=DatasetSpec)
    rewards: list[RewardSpec] | None = Field(
        None, min_length=1, description="Reward functions, summed with weights; default depends on the dataset."
    )
    devices: DevicesSpec = Field(default_factory=DevicesSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    sparsity: SparsitySpec | None = Field(None, description="Parameter-update sparsity reports; omit to skip.")
    health: HealthSpec = Field(default_factory=HealthSpec, description="Thresholds of the per-step health guards "
                               "(flagged as `health` events, summed up on the job) and which of them stop the job.")

    @property
    def train(self) -> TrainSpec:
        """The kind's training section (grpo, sft): what every loop's skeleton reads."""
        raise NotImplementedError

    @property
    def gpus(self) -> int:
        """The GPUs this job needs on one worker (0: any worker)."""
        return gpus_needed(self.devices, self.resources.processes)

    @property
    def nodes(self) -> int:
        """The machines (workers) this job runs on."""
        return self.resources.nodes

    def reward_specs(self) -> list[RewardSpec]:
        if self.rewards:
            return self.rewards
        return [FunctionReward(name=n) for n in DEFAULT_REWARDS[self.dataset.name]]

    @model_validator(mode="after")
    def _common(self) -> _JobBase:
        for rule in CROSS_SECTION_RULES:  # in order: the first broken rule is the one reported
            rule(self)
        return self


def _rewards_rule(job: _JobBase) -> None:
    """Some reward counts, and each entry's metric has a name of its own."""
    if job.rewards is not None and all(r.weight == 0 for r in job.rewards):
        raise ValueError("rewards: at least one reward needs a non-zero weight")
    keys = [r.key for r in job.reward_specs()]
    if dup := sorted({k for k in keys if keys.count(k) > 1}):
        raise ValueError(f"rewards: two entries named {', '.join(dup)}: give each a different `tag` "
                         "(it names the entry's metric reward/<tag>/mean)")


def _processes_rule(job: _JobBase) -> None:
    """Several processes (on one node or several) share a step evenly and each takes its own device."""
    if job.resources.sharding == "fsdp" and job.resources.world < 2:
        raise ValueError("resources.sharding 'fsdp' needs resources.processes >= 2 (or nodes >= 2) to shard across")
    if (n := job.resources.world) <= 1:
        return
    field, units = job.train.per_step
    if units % n:
        what = f"resources.processes ({n})" if job.resources.nodes == 1 else \
            f"resources.nodes x processes ({job.resources.nodes} x {job.resources.processes} = {n})"
        raise ValueError(f"{field} ({units}) must be divisible by {what}: each process takes an equal share of a "
                         "step")
    _fsdp_rule(job)
    if job.devices.rollout is not None or ":" in job.devices.policy:
        raise ValueError("devices: with resources.processes > 1 each process takes its own device (a GPU "
                         "each where there are enough, else the CPU): leave devices.policy 'auto', "
                         "'cpu' or 'cuda' and devices.rollout unset")


def _fsdp_rule(job: _JobBase) -> None:
    """FSDP2 shards a fully fine-tuned GRPO policy whose processes run in lockstep."""
    if job.resources.sharding != "fsdp":
        return
    if job.kind != "grpo":
        raise ValueError(f"resources.sharding 'fsdp' is supported for kind 'grpo', not {job.kind!r}: "
                         "its processes each hold the whole model (sharding 'none')")
    if job.model.lora is not None:
        raise ValueError("resources.sharding 'fsdp' shards a fully fine-tuned model: remove model.lora "
                         "(a LoRA job's trained weights are small; use sharding 'none')")
    if getattr(job.train, "drop_zero_std_groups", False):
        raise ValueError("resources.sharding 'fsdp' runs every process's forwards in lockstep, so each "
                         "takes the same number of prompts: grpo.drop_zero_std_groups (refills of "
                         "uneven size) is not supported with it")
    if job.sparsity is not None and job.sparsity.quality.enabled:
        raise ValueError("sparsity.quality is not supported with resources.sharding 'fsdp': its probe "
                         "rewrites the weights, which are sharded")
    if job.model.dtype in ("bfloat16", "float16"):
        raise ValueError(f"model.dtype {job.model.dtype!r} is not supported with resources.sharding 'fsdp': a "
                         "fully fine-tuned low-precision model needs float32 master weights (else AdamW's small "
                         "updates round away), which the unsharded optimizer keeps and sharded weights do not; "
                         "use model.dtype 'float32', or sharding 'none'")


def _vllm_rule(job: _JobBase) -> None:
    """A vLLM server loads whole weights in a dtype it serves, on its own device."""
    if job.rollout.engine != "vllm":
        return
    if job.resources.sharding == "fsdp":
        raise ValueError("rollout.engine 'vllm' is not supported with resources.sharding 'fsdp': the "
                         "server loads whole weights; use sharding 'none'")
    if job.model.dtype == "float64":
        raise ValueError("rollout.engine 'vllm' serves float32, bfloat16 or float16: set model.dtype to one "
                         "of them")
    if job.devices.rollout is not None:
        raise ValueError("devices.rollout places the hf engine's copy; with rollout.engine 'vllm' the "
                         "server takes its own device: remove devices.rollout")


# Presets whose tokenizer's chat template has no tools branch (the tiny ones have no template: a job with
# tools renders them with model.chat_template; one without gets a readable error when the job starts).
TEMPLATE_WITHOUT_TOOLS = ("smollm2-135m-instruct", "tiny-random-llama", "tiny-random-qwen")


DEMO_ENVIRONMENTS = ("calculator", "multiplication")  # bundled environments a scripted solver plays


def _demos_rule(job: _JobBase, env: EnvironmentSpec) -> None:
    """An SFT job's environment is where its demonstrations come from."""
    if job.dataset.name != "env-demos":
        raise ValueError("environment on kind 'sft' is where `dataset: env-demos` plays its demonstrations: set "
                         "dataset.name to env-demos, or remove environment")
    if job.rewards is not None:
        raise ValueError("rewards would have no effect on demonstrations: the environment's greedy episodes "
                         "evaluate the job; remove rewards")
    if env.name not in DEMO_ENVIRONMENTS or env.tools != "mcp":
        raise ValueError(f"dataset env-demos: a scripted solver plays the bundled {' or '.join(DEMO_ENVIRONMENTS)} "
                         "environment with its MCP tools: set environment.name to one of them and environment.tools "
                         "to mcp")
    if job.resources.world > 1:
        raise ValueError("environment: a job with an environment runs as one process; set resources.processes and "
                         "resources.nodes to 1")


def _environment_rule(job: _JobBase) -> None:
    """An environment's episodes replace the dataset's prompts and its reward the reward functions."""
    env = getattr(job, "environment", None)
    if env is None:
        if job.dataset.name == "env-demos":
            raise ValueError("dataset.name 'env-demos' plays the job's environment: add environment (kind 'sft')")
        return
    if env.tools is not None and job.model.name in TEMPLATE_WITHOUT_TOOLS and job.model.chat_template == "tokenizer":
        raise ValueError(f"environment.tools: {job.model.name}'s own chat template cannot show tools to the model; "
                         "set model.chat_template: chatml-tools")
    if job.kind == "sft":
        _demos_rule(job, env)
        return
    if job.kind not in ("grpo", "tracin"):
        raise ValueError(f"environment is supported for kinds 'grpo', 'tracin' and 'sft', not {job.kind!r}: its "
                         "episodes are sampled per reset seed, which a joint query's documents are not")
    if job.dataset.name == "env-demos":
        raise ValueError("dataset.name 'env-demos' trains kind 'sft' on demonstrations; a GRPO job with an "
                         "environment plays its own episodes: remove dataset")
    if job.rewards is not None:
        raise ValueError("rewards would have no effect with an environment: an episode's reward is the "
                         "environment's; remove rewards")
    if job.dataset != DatasetSpec():  # compared with the default: a stored spec names every field
        raise ValueError("dataset would have no effect with an environment: its episodes start from the "
                         "environment's reset; remove dataset")
    if job.resources.world > 1:
        raise ValueError("environment: a job with an environment runs as one process; set "
                         "resources.processes and resources.nodes to 1")


def _staleness_rule(job: _JobBase) -> None:
    """Sampling a step ahead is implemented by the GRPO and TracIn loops."""
    if job.rollout.max_staleness and job.kind not in ("grpo", "tracin"):
        raise ValueError(f"rollout.max_staleness 1 is supported for kinds 'grpo' and 'tracin', not {job.kind!r}: "
                         "set it to 0")


CROSS_SECTION_RULES = (_rewards_rule, _processes_rule, _vllm_rule, _environment_rule, _staleness_rule)


def _no_corpus(d: DatasetSpec) -> None:
    """Kinds without a retriever: no retrieval task, no corpus."""
    if d.name == "persona-facts":
        raise ValueError("dataset.name 'persona-facts' is a retrieval task: use kind 'joint'")
    reject_unused(d, "dataset", ("corpus_path", "corpus_file"), unless="to kind 'joint' (a corpus to retrieve from)")


class _GRPOKinds(_JobBase):
    """The kinds that train with GRPO."""

    grpo: GRPOSpec = Field(default_factory=GRPOSpec)
    selection: SelectionSpec = Field(default_factory=SelectionSpec, description="Which prompts (or environment "
                                     "seeds) each step draws: uniformly, or by their predicted learning signal.")
    environment: EnvironmentSpec | None = Field(
        None, description="A multi-turn environment (OpenEnv) whose episodes the job trains on instead of "
        "the dataset's single completions; omit for single-turn jobs.")

    @property
    def train(self) -> GRPOSpec:
        return self.grpo


class GRPOJob(_GRPOKinds):
    """GRPO / GRPO-Clip: group sampling, group-normalised advantages, clipped surrogate, k3 KL."""

    kind: Literal["grpo"] = "grpo"

    @model_validator(mode="after")
    def _dataset(self) -> GRPOJob:
        _no_corpus(self.dataset)
        return self


class TracInJob(_GRPOKinds):
    """GRPO that trains only on samples whose TracIn influence on a validation batch helps."""

    kind: Literal["tracin"] = "tracin"
    tracin: TracInSpec = Field(default_factory=TracInSpec)

    @model_validator(mode="after")
    def _needs_lora(self) -> TracInJob:
        if self.model.lora is None:
            raise ValueError("model.lora is required for kind 'tracin': influence is computed over LoRA weights")
        _no_corpus(self.dataset)
        return self


class JointJob(_GRPOKinds):
    """Joint retriever + generator GRPO: k documents per query, G answers per document."""

    kind: Literal["joint"] = "joint"
    retriever: RetrieverSpec = Field(default_factory=RetrieverSpec)

    @model_validator(mode="after")
    def _needs_corpus(self) -> JointJob:
        d = self.dataset
        if d.name == "arith":
            raise ValueError("dataset.name 'arith' has no corpus: kind 'joint' needs 'persona-facts' or 'jsonl'")
        if d.name == "jsonl" and not d.corpus_path:
            raise ValueError("dataset.corpus_path is required for kind 'joint' with a jsonl dataset")
        if d.name == "file" and not d.corpus_file:
            raise ValueError("dataset.corpus_file is required for kind 'joint' with dataset.name 'file'")
        return self


class SFTJob(_JobBase):
    """Supervised fine-tuning: cross-entropy on the answer tokens of {prompt, answer} rows."""

    kind: Literal["sft"] = "sft"
    sft: SFTSpec = Field(default_factory=SFTSpec)
    environment: EnvironmentSpec | None = Field(
        None, description="With `dataset: env-demos`: the bundled tool environment (calculator or multiplication, "
        "`tools: mcp`) whose demonstrations the job trains on and whose greedy episodes evaluate it; the cold "
        "start before a GRPO job in the same environment.")

    @property
    def train(self) -> SFTSpec:
        return self.sft

    @model_validator(mode="after")
    def _dataset(self) -> SFTJob:
        _no_corpus(self.dataset)
        return self


class SessionSpec(_Section):
    """What the tinker client asked for when it created the training run (`create_model`)."""

    tinker_session: str = Field(max_length=40, description="The tinker SDK session that created this run.")
    model_id: str = Field(pattern=r"^[0-9a-f]{32}$", description="The run's id for the SDK: its job's uid.")
    model_seq_id: int = Field(0, ge=0, le=2**31 - 1, description="The client's number for this run in its session.")
    seed: int | None = Field(None, ge=0, le=2**32 - 1, description="Seed of the LoRA initialisation (random when null).")
    idle_timeout_s: float = Field(120.0, gt=0, le=86400, description="A worker holding the run gives it back after "
                                  "this long with no operation; the next operation brings it back from its last state.")
    sampling_only: bool = Field(False, description="A run create_sampling_session made for a base model: it samples "
                                "the model's own weights and trains nothing.")


class SessionJob(_Section):
    """A training run driven operation by operation from the tinker SDK (`forward_backward`,
    `optim_step`, ...): created by `/api/v1/create_model`, never submitted as a spec."""

    kind: Literal["session"] = "session"
    name: str | None = Field(None, max_length=200, description="Free-text label shown in lists and the dashboard.")
    model: ModelSpec = Field(default_factory=ModelSpec)
    devices: DevicesSpec = Field(default_factory=DevicesSpec)
    session: SessionSpec

    @property
    def gpus(self) -> int:
        """The GPUs this run needs on one worker (0: any worker)."""
        return gpus_needed(self.devices, 1)

    @property
    def nodes(self) -> int:
        """A session run runs on one machine."""
        return 1


SubmittedSpec = Annotated[GRPOJob | TracInJob | JointJob | SFTJob, Field(discriminator="kind")]  # what a client submits
JobSpec = Annotated[GRPOJob | TracInJob | JointJob | SFTJob | SessionJob, Field(discriminator="kind")]  # what is stored
JOB_MODELS: tuple[type[_JobBase], ...] = get_args(get_args(SubmittedSpec)[0])
KINDS: tuple[str, ...] = tuple(get_args(m.model_fields["kind"].annotation)[0] for m in get_args(get_args(JobSpec)[0]))
_SUBMITTED_SPEC: TypeAdapter[SubmittedSpec] = TypeAdapter(SubmittedSpec)
_JOB_SPEC: TypeAdapter[JobSpec] = TypeAdapter(JobSpec)


def parse_spec(data: object) -> GRPOJob | TracInJob | JointJob | SFTJob:
    """A submitted job spec from its JSON form (a request body, a YAML file); ValidationError if wrong."""
    return _SUBMITTED_SPEC.validate_python(data)


def parse_stored_spec(data: object) -> GRPOJob | TracInJob | JointJob | SFTJob | SessionJob:
    """A stored job's spec, session runs included; ValidationError if this version cannot read it."""
    return _JOB_SPEC.validate_python(data)


class Status(StrEnum):
    """A job's status: queued -> running -> succeeded | failed | cancelled (service/store/leases.py); a session
    run also goes running -> idle -> queued."""

    queued = "queued"
    running = "running"
    idle = "idle"  # a session run no worker holds until its next operation arrives
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


STATUSES: tuple[str, ...] = tuple(s.value for s in Status)
TERMINAL: tuple[str, ...] = (Status.succeeded.value, Status.failed.value, Status.cancelled.value)
