"""What a loop builds once per job: policy, rollout copy, reference, optimizer, data; and resuming it."""

from __future__ import annotations

import copy
import dataclasses
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Generic, TypeVar, cast

import torch
from transformers import PreTrainedTokenizerBase

from service.core.fingerprint import EVENT as FINGERPRINT
from service.core.settings import Settings
from service.core.specs import PAIRWISE, GRPOJob, GRPOSpec, InitFrom, JointJob, SFTJob, TracInJob
from worker.algos.lora import base_model, is_lora
from worker.batch import RolloutEngine, SamplingParams
from worker.datasets import TaskData, load_task, render_example
from worker.engines.folded import adapted_bytes, foldable
from worker.engines.hf_engine import HFEngine, eos_token_ids
from worker.engines.vllm_engine import EngineFailed, VLLMEngine, place_engine
from worker.environments.demos import demonstrations
from worker.environments.host import EnvironmentHost, open_environment
from worker.loops.draws import Learnability
from worker.machine import allocator, memory, precision
from worker.machine.fingerprint import fingerprint, model_sha256
from worker.model.checkpoints import (
    Trainables,
    load_checkpoint,
    load_weights,
)
from worker.model.loading import enable_checkpointing, load_policy
from worker.parallel.distributed import SINGLE, Ranks, shard
from worker.parallel.launch import place, trainer_gpus, visible_gpus
from worker.reporting import Records, Reporter
from worker.rewards import RewardFailure, Scorer, build_scorer
from worker.training import has_dropout, make_optimizer, make_scheduler, trainable

AnySpec = GRPOJob | TracInJob | JointJob | SFTJob
RLJob = GRPOJob | TracInJob | JointJob  # the kinds that sample groups and score them: what the RL parts read
S = TypeVar("S", bound=AnySpec, covariant=True)  # a Setup[GRPOJob] is a Setup[RLJob]: it is frozen
J = TypeVar("J", bound=AnySpec)


@dataclass(frozen=True)
class Setup(Generic[S]):
    """Everything a loop builds once per job; `Setup[RLJob]` where a part reads the GRPO section."""

    spec: S
    model: torch.nn.Module  # the trained policy (a peft model with LoRA)
    tokenizer: PreTrainedTokenizerBase
    engine: RolloutEngine  # samples; old_logp from the second epoch on
    ref_model: torch.nn.Module | None  # a frozen copy for full fine-tuning with KL; LoRA disables the adapter instead
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    task: TaskData
    scorer: Scorer  # the job's weighted rewards
    device: torch.device
    extra: dict[str, torch.nn.Module] = field(default_factory=dict)  # other trained modules (the retriever)
    extra_optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)
    extra_schedulers: dict[str, torch.optim.lr_scheduler.LRScheduler] = field(default_factory=dict)
    ranks: Ranks = SINGLE  # this process's place among the job's processes (worker/parallel/distributed.py)
    sharded: bool = False  # the policy is sharded across the processes (FSDP2)
    memory_plan: memory.CheckpointPlan | None = None  # whether activations are recomputed, and why
    environment: EnvironmentHost | None = None  # where a multi-turn job's episodes are played
    prompt_draw: Learnability | None = None  # selection.prompts learnability: the training draw, kept across steps

    @property
    def share_prompts(self) -> bool:
        """Whether a group's rows share their prompt's forward (grpo.share_prompts; worker/model/prefix.py):
        not with a sharded policy, whose processes' forwards must stay in lockstep; under TracIn, not for the
        selections that compare samples with each other (their Gram matrix needs every row's own prompt)
        nor with dropout (the prompts' extra passes would draw other masks)."""
        if not (isinstance(self.spec.train, GRPOSpec) and self.spec.train.share_prompts) or self.sharded:
            return False
        tracin = getattr(self.spec, "tracin", None)
        return tracin is None or (tracin.selection not in PAIRWISE and not has_dropout(self.model))

    def trainables(self) -> Trainables:
        """What a checkpoint holds."""
        return Trainables(model=self.model, tokenizer=self.tokenizer,
                          optimizers={"policy": self.optimizer, **self.extra_optimizers},
                          schedulers={"policy": self.scheduler, **self.extra_schedulers}, modules=dict(self.extra),
                          sharded=self.sharded)


def rl(s: Setup[AnySpec]) -> Setup[RLJob]:
    """`s` as a job that samples and scores groups (grpo, tracin, joint): what the RL parts take."""
    if isinstance(s.spec, SFTJob):
        raise TypeError("an SFT job has no GRPO section: it runs no rollouts")
    return cast(Setup[RLJob], s)


def of_kind(s: Setup[AnySpec], kind: type[J]) -> Setup[J]:
    """`s` as the setup of a `kind` job: what that kind's own parts take."""
    if not isinstance(s.spec, kind):
        raise TypeError(f"a {s.spec.kind} job, not a {kind.__name__}")
    return cast(Setup[J], s)


def policy_device(spec: AnySpec, ranks: Ranks) -> str:
    """devices.policy as the worker places it, or with several processes each rank's own (its GPU, or the CPU)."""
    return ranks.device if ranks.world > 1 else place(spec.devices.policy, visible_gpus())


def build(spec: J, settings: Settings, reporter: Reporter, *, task: TaskData | None = None,
          extra: dict[str, torch.nn.Module] | None = None,
          extra_optimizers: dict[str, torch.optim.Optimizer] | None = None,
          extra_schedulers: dict[str, torch.optim.lr_scheduler.LRScheduler] | None = None,
          ranks: Ranks = SINGLE) -> Setup[J]:
    """Load the policy (and `model.init_from`'s weights), the rollout copy, the reference, the
    optimizer and schedule, and the task (unless the loop loaded its own)."""
    g = spec.train
    dev = policy_device(spec, ranks)
    device = torch.device(dev)
    spec, prec = with_precision(spec, settings, device)
    # checkpointing is switched on below, once the task's prompts tell how long a micro-batch's rows are
    mspec = spec.model.model_copy(update={"gradient_checkpointing": False})
    model, tok = load_policy(mspec, models_root=settings.models_dir, device=dev, seed=g.seed,
                             model_roots=settings.model_roots)
    model_hash = model_sha256(spec.model.name, settings, model) if ranks.main else ""
    init_weights(model, spec.model.init_from, reporter)
    entries = spec.reward_specs()
    if task is None:
        task = job_task(spec, settings, reporter, tok)
    if ranks.main:  # what ran, for reproducing it (every rank runs the same)
        fp = fingerprint(spec, settings, model_hash=model_hash, task=task, device=dev, model=model)
        reporter.event(FINGERPRINT, f"spec {fp.spec_sha256[:12]}, data {fp.data_sha256[:12]}, model "
                       f"{fp.model_sha256[:12]}, grpo-jobs {fp.commit or fp.version}", data=fp.model_dump())
    plan = checkpoint_plan(spec, settings, model, tok, task, device, ranks)
    if plan.checkpointing:  # before sharding: FSDP2 switches it to the non-reentrant kind
        enable_checkpointing(base_model(model), reentrant=True)
    malloc = allocator.prepare_for_steps(keep_freed=settings.keep_freed_memory) if device.type == "cpu" else None
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in model.parameters())
    reporter.event("model_loaded", f"{spec.model.name}: {n_train:,} trainable of {n_all:,} parameters",
                   data={"trainable": n_train, "total": n_all, "lora": spec.model.lora is not None, "malloc": malloc})
    sharded = spec.resources.sharding == "fsdp"
    fold = fold_plan(spec, settings, model, device, ranks=ranks, sharded=sharded)
    report_memory_plan(reporter, plan, fold, prec)
    params = SamplingParams(max_new_tokens=g.max_new_tokens, stop=tuple(g.stop))  # SFT only samples greedily
    if isinstance(g, GRPOSpec):
        params = dataclasses.replace(params, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k)
    ref = None
    if g.with_reference and not is_lora(model):
        ref = copy.deepcopy(model).eval().requires_grad_(False)
    if sharded:  # FSDP2: each rank keeps its shard of the policy, the reference, their gradients and AdamW's state
        shard(model, ranks)
        if ref is not None:
            shard(ref, ranks)
    engine = rollout_engine(spec, settings, reporter, model, tok, dev, params, ranks=ranks, sharded=sharded,
                            fold=bool(fold and fold.fold))
    opt = make_optimizer(trainable(model), lr=g.learning_rate, weight_decay=g.weight_decay, betas=g.betas)
    sched = make_scheduler(opt, schedule=g.lr_schedule, warmup=g.warmup_steps * g.epochs_per_step,
                           total=g.steps * g.epochs_per_step)
    scorer = build_scorer(entries, settings=settings, device=dev, job_id=reporter.job_id,
                          on_failures=partial(warn_reward_failures, reporter))
    # one process: a cancel stops the step's episodes; ranks ask it together, between steps
    environment = job_environment(spec, settings, reporter, engine, model, tok,
                                  stop=reporter.should_stop if ranks.world == 1 else _never)
    return Setup(spec=spec, model=model, tokenizer=tok, engine=engine, ref_model=ref, optimizer=opt, scheduler=sched,
                 task=task, scorer=scorer, device=device, extra=dict(extra or {}),
                 extra_optimizers=dict(extra_optimizers or {}), extra_schedulers=dict(extra_schedulers or {}),
                 ranks=ranks, sharded=sharded, memory_plan=plan, environment=environment,
                 prompt_draw=learnability_draw(spec, task, environment))


def learnability_draw(spec: AnySpec, task: TaskData, environment: EnvironmentHost | None) -> Learnability | None:
    """A GRPO or TracIn job's training draw by predicted learning signal (selection.prompts learnability), over
    its train prompts or its environment's training units; None for the uniform draw."""
    selection = getattr(spec, "selection", None)
    if selection is None or selection.prompts != "learnability" or not isinstance(spec.train, GRPOSpec):
        return None
    units = environment.training_units() if environment is not None else None
    return Learnability(size=units.count if units else len(task.train), offset=units.first if units else 0,
                        group_size=spec.train.num_generations, threshold=selection.passed_at, floor=selection.floor)


# The train prompts whose rendered length bounds a micro-batch's rows in the memory estimate.
PLAN_PROMPTS = 256


def checkpoint_plan(spec: AnySpec, settings: Settings, model: torch.nn.Module, tok: PreTrainedTokenizerBase, task: TaskData,
                    device: torch.device, ranks: Ranks = SINGLE) -> memory.CheckpointPlan:
    """model.gradient_checkpointing, or when unset, the estimate of what one micro-batch keeps without it
    (micro_batch_size rows, at most micro_batch_tokens positions, of the longest of the first
    PLAN_PROMPTS train prompts plus max_new_tokens) against GRPO_MEMORY_BUDGET_GB or what is free. A job's
    processes on a CPU share its memory, so each plans on its share; all of them checkpoint if one must."""
    g = spec.train
    prompts = [render_example(tok, ex, task.instruction) for ex in task.train[:PLAN_PROMPTS]]
    longest = max((len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts), default=0)
    env = getattr(spec, "environment", None)
    positions = longest + max(g.max_new_tokens, env.max_episode_tokens if env is not None else 0)
    rows = g.micro_batch_size
    if g.micro_batch_tokens is not None:
        rows = max(1, min(rows, g.micro_batch_tokens // positions))
    base = base_model(model)
    dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)  # activations in at least float32
    activations = memory.activation_bytes(base.config, rows=rows, positions=positions, dtype=dtype)
    budget = memory_budget_gb(settings, device, ranks)
    plan = memory.plan_checkpointing(spec.model.gradient_checkpointing, activations=activations, budget_gb=budget)
    anyone = ranks.max({"checkpointing": float(plan.checkpointing)})["checkpointing"] > 0
    return dataclasses.replace(plan, checkpointing=anyone)


def report_memory_plan(reporter: Records, plan: memory.CheckpointPlan, fold: memory.FoldPlan | None,
                       prec: precision.Precision) -> None:
    """The `memory_plan` event: the base weights' dtype, checkpointing, and the sampler's fold where it could
    fold."""
    message, data = plan.event()
    if fold is not None:
        message, data = f"{message}; {fold.describe()}", {**data, "sampler_fold": fold.fold,
                                                           "sampler_fold_gb": fold.copy_gb}
    if prec.auto:  # say what was chosen and why
        message = f"{prec.reason}; {message}"
    elif prec.activations == "float32":  # a named bfloat16/float16: what flows between its matmuls
        message = f"{prec.dtype} base weights, float32 activations; {message}"
    reporter.event("memory_plan", message, data={**data, "precision": prec.data()})


def with_precision(spec: J, settings: Settings, device: torch.device) -> tuple[J, precision.Precision]:
    """The spec with `model.dtype` and `model.activations` as this device loads them (`auto` resolved), and why."""
    prec = precision.resolve_as_set(spec.model.dtype, spec.model.activations, device, settings,
                                    bfloat16_ok=bfloat16_refused(spec))
    model = spec.model.model_copy(update={"dtype": prec.dtype, "activations": prec.activations})
    resolved = spec.model_copy(update={"model": model})
    return cast(J, resolved), prec


def bfloat16_refused(spec: AnySpec) -> str | None:
    """Why `model.dtype: auto` may not choose bfloat16 for this job (None: it may)."""
    if getattr(getattr(spec, "resources", None), "sharding", "none") == "fsdp":
        return "resources.sharding 'fsdp' trains float32 weights only"
    return None


def memory_budget_gb(settings: Settings, device: torch.device, ranks: Ranks = SINGLE) -> float | None:
    """What one process of a job may plan on: GRPO_MEMORY_BUDGET_GB or what is free, shared by the job's
    processes on a CPU."""
    budget = settings.memory_budget_gb if settings.memory_budget_gb is not None else memory.available_gb(device)
    if budget is not None and device.type == "cpu":
        budget /= ranks.local_world
    return budget


def fold_plan(spec: AnySpec, settings: Settings, model: torch.nn.Module, device: torch.device, *, ranks: Ranks,
              sharded: bool) -> memory.FoldPlan | None:
    """Whether the `hf` sampler folds the LoRA adapter into a copy of the adapted weights (None: it cannot:
    another engine, a sharded policy, a rollout copy on another device, or an adapter it cannot fold)."""
    if spec.rollout.engine != "hf" or sharded or (spec.devices.rollout or str(device)) != str(device):
        return None
    layers = foldable(model)
    if layers is None:
        return None
    return memory.plan_fold(adapted_bytes(layers), budget_gb=memory_budget_gb(settings, device, ranks))


def rollout_engine(spec: AnySpec, settings: Settings, reporter: Reporter, model: torch.nn.Module, tok: PreTrainedTokenizerBase, dev: str,
                   params: SamplingParams, *, ranks: Ranks, sharded: bool, fold: bool = False) -> RolloutEngine:
    """The job's `rollout.engine`: a frozen copy sampled with generate, or a vLLM server of its own."""
    if spec.rollout.engine == "hf":
        return HFEngine(model, tok, spec.devices.rollout or dev, params, sharded=sharded, fold=fold)
    if settings.vllm_python is None:
        raise EngineFailed("rollout.engine 'vllm' needs a worker whose GRPO_VLLM_PYTHON names the Python of a vLLM "
                           "environment (`make vllm` builds one); this worker has none")
    args = tuple(shlex.split(settings.vllm_args))
    # the job's share of a GPU's memory wins over the admin's default in GRPO_VLLM_ARGS, which wins over ours
    admin = option_value(args, "--gpu-memory-utilization")
    args = without_option(args, "--gpu-memory-utilization")
    asked = spec.rollout.gpu_memory_utilization or (float(admin) if admin else None)
    placement = place_engine(trainer_gpus(dev, ranks.local_world), visible_gpus(), asked)
    if torch.device(dev).type == "cpu" and "--enforce-eager" not in args:
        args += ("--enforce-eager",)  # compiling the model takes minutes on a CPU and gains little there
    base = base_model(model)
    # the longest sequence the server takes (its KV cache must hold one): the model's own, within reason
    max_model_len = min(int(getattr(base.config, "max_position_embeddings", 4096)), 16384)
    workdir = settings.data_dir / "engines" / f"{reporter.job_id or 'local'}-{os.getpid()}"
    return VLLMEngine(model, tok, dev, params, python=settings.vllm_python, workdir=workdir,
                      max_model_len=max_model_len, extra_args=args,
                      start_timeout_s=settings.vllm_start_timeout_s, ranks=ranks, placement=placement,
                      on_event=lambda kind, message, data: reporter.event(kind, message, data=data))


def option_value(args: tuple[str, ...], option: str) -> str | None:
    """The value of the last `option` in `args` (`--option V` or `--option=V`), None when absent."""
    value = None
    for a, b in zip(args, (*args[1:], None)):
        if a == option:
            value = b
        elif a.startswith(option + "="):
            value = a.split("=", 1)[1]
    return value


def without_option(args: tuple[str, ...], option: str) -> tuple[str, ...]:
    """`args` less `option` and its value (`--option V` or `--option=V`)."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == option:
            skip = True
        elif not a.startswith(option + "="):
            out.append(a)
    return tuple(out)


def _never() -> bool:
    return False


def job_task(spec: AnySpec, settings: Settings, reporter: Reporter, tok: PreTrainedTokenizerBase) -> TaskData:
    """The spec's dataset; demonstrations (`env-demos`) are played now, in a bundled server of their own."""
    if spec.dataset.name != "env-demos":
        return load_task(spec.dataset, settings=settings, reward_names=[e.name for e in spec.reward_specs()],
                         fetch=reporter.data_file)
    assert isinstance(spec, SFTJob) and spec.environment is not None
    task = demonstrations(spec, settings, tok, environment_logs(settings, reporter))
    reporter.event("demonstrations", f"{len(task.train)} training and {len(task.val)} validation demonstrations of "
                   f"the {spec.environment.name} environment, played by its solver",
                   data={"train": len(task.train), "val": len(task.val)})
    return task


def environment_logs(settings: Settings, reporter: Reporter) -> Path:
    """Where a job's environment servers write their logs."""
    return settings.data_dir / "environments" / f"{reporter.job_id or 'local'}-{os.getpid()}"


def job_environment(spec: AnySpec, settings: Settings, reporter: Reporter, engine: RolloutEngine,
                    model: torch.nn.Module, tok: PreTrainedTokenizerBase, *, stop: Callable[[], bool] = _never) -> EnvironmentHost | None:
    """The spec's environment, its server started (bundled) or its URL checked; None for single-turn jobs."""
    env = getattr(spec, "environment", None)
    if env is None:
        return None
    positions = getattr(base_model(model).config, "max_position_embeddings", None)
    if positions is not None and env.max_observation_tokens + env.max_episode_tokens > positions:
        raise ValueError(f"environment.max_observation_tokens + environment.max_episode_tokens ({env.max_observation_tokens}"
                         f" + {env.max_episode_tokens}) is more than {spec.model.name} holds ({positions} positions, "
                         "the first prompt included): lower them")
    host = open_environment(env, settings, engine=engine, tokenizer=tok, eos_ids=eos_token_ids(tok, model),
                            chat=spec.dataset.chat_template, max_new_tokens=spec.train.max_new_tokens,
                            log_dir=environment_logs(settings, reporter),
                            stop=stop)
    tools = [t.name for t in host.players.tools.tools]
    shown = f", the model shown its tools: {', '.join(tools)}" if tools else ""
    if env.name is not None:  # its address is the worker's: only the admin's keys see it (server_url)
        reporter.event("environment", f"episodes in the bundled {env.name} environment{shown}",
                       data={"server_url": host.url, "bundled": env.name, "tools": tools})
    else:
        reporter.event("environment", f"episodes in {host.url}{shown}", data={"url": host.url, "tools": tools})
    return host


def warn_reward_failures(reporter: Records, failures: list[RewardFailure], step: int) -> None:
    """What could not be scored (in training or evaluation), as one warning event."""
    reporter.event("warning", f"{len(failures)} reward evaluations failed at step {step}; those completions are "
                   "excluded (from the loss, or from eval/reward_mean)", level="warning",
                   data={"failures": [dataclasses.asdict(f) for f in failures[:20]]})


@dataclass(frozen=True)
class Resumed:
    """Where an attempt starts: step 0, or the last checkpoint of an earlier attempt."""

    step: int = 0
    opt_steps: int = 0  # optimizer steps already taken (epochs count separately)


def resume(s: Setup[AnySpec], reporter: Reporter) -> Resumed:
    """Restore the job's latest checkpoint, if an earlier attempt left one."""
    ckpt = reporter.resume_from()
    if ckpt is None:
        return Resumed()
    state = load_checkpoint(ckpt, s.trainables())
    if s.prompt_draw is not None and "prompt_draw" in state.extra:  # the posteriors as the step left them
        s.prompt_draw.load_state_dict(state.extra["prompt_draw"])
    reporter.event("resumed", f"resumed from checkpoint at step {state.step}", data={"step": state.step})
    opt_steps = state.opt_steps if state.opt_steps is not None else state.step * s.spec.train.epochs_per_step
    return Resumed(state.step, opt_steps)


def init_weights(model: torch.nn.Module, init: InitFrom | None, reporter: Reporter) -> None:
    """`model.init_from`'s weights (an earlier checkpoint of the owner's) loaded into `model`; nothing
    when unset. Job loops train on from them; a session run samples them."""
    if init is None:
        return
    found = reporter.init_checkpoint(init.job, init.step)
    load_weights(found.path, model=model)
    reporter.event("initialised", f"weights from {found.source or f'job {found.job}'}, step {found.step}",
                   data={"job": found.job, "step": found.step, **({"source": found.source} if found.source else {})})
