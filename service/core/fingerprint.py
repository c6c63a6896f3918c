"""A job's fingerprint: exactly what ran, so that a run can be reproduced and two runs compared.

The worker records one per attempt (a `fingerprint` event) once the model and the data are
loaded; the API serves the latest on the job. Two attempts with equal fingerprints ran the same
spec, code, libraries, hardware, seeds, data and weights: on a CPU their metrics agree to float
rounding (`grpo-jobs reproduce ID --wait` checks it)."""

from __future__ import annotations

from pydantic import BaseModel, Field

EVENT = "fingerprint"
# Metric names the machine measures (times, rates, memory, utilisation) rather than the run learns:
# they differ between two runs of one fingerprint, and are left out when runs are compared.
MEASURED = ("time/", "throughput/", "memory/", "mfu/", "mbu/", "tracin/time_s", "sparsity/time_s", "health/grader_time")


class Hardware(BaseModel):
    cpu: str = Field(description="The CPU's model name.")
    cores: int = Field(description="Logical CPUs the worker's machine has.")
    threads: int = Field(description="Threads torch computes with in the job's process.")
    cpu_capability: str = Field(description="The CPU kernel set torch dispatches to (ATEN_CPU_CAPABILITY).")
    gpus: list[str] = Field(description="GPU names the job's process sees (empty on a CPU worker).")
    device: str = Field(description="The device the policy trains on.")


class Fingerprint(BaseModel):
    spec_sha256: str = Field(description="SHA-256 of the resolved spec (every default filled in), as canonical JSON.")
    version: str = Field(description="grpo-jobs' version.")
    commit: str | None = Field(description="The git commit of the worker's source, with '+dirty' when it has "
                               "uncommitted changes (null: not run from a git checkout).")
    libraries: dict[str, str] = Field(description="Versions of python, torch, transformers, peft (and vllm when the "
                                      "job samples with it).")
    hardware: Hardware
    seeds: dict[str, int] = Field(description="The training seed and the dataset's seed.")
    processes: int = Field(description="Processes (ranks) the job ran as.")
    data_sha256: str = Field(description="SHA-256 of the loaded task: every train and validation example (and the "
                             "corpus of a retrieval task).")
    model_sha256: str = Field(description="SHA-256 of the base model's weight files (a tiny preset: of its weights).")
    dtype: str = Field("", description="The dtype the base weights were loaded in (`model.dtype: auto` resolved; "
                       "empty: recorded before it was).")
    activations: str = Field("", description="The dtype between a low-precision model's matmuls (`model."
                             "activations` resolved: float32 or weights; empty: recorded before it was).")
    trainable_sha256: str = Field("", description="SHA-256 of the weights training starts from: the trainable "
                                  "parameters after LoRA's initialisation and `model.init_from` (empty: recorded "
                                  "before it was measured). Two runs of one seed start from equal weights when "
                                  "these are equal.")

    def differences(self, other: Fingerprint) -> list[str]:
        """The fields in which two fingerprints differ (hardware's by name)."""
        out = [k for k in type(self).model_fields if k != "hardware" and getattr(self, k) != getattr(other, k)]
        out += [f"hardware.{k}" for k in Hardware.model_fields
                if getattr(self.hardware, k) != getattr(other.hardware, k)]
        return out


def largest_difference(a: dict[str, dict[int, float]], b: dict[str, dict[int, float]]) -> tuple[list[str], float]:
    """Two runs' learned metrics (key -> step -> value, measured ones left out) compared: the keys
    whose steps differ, and the largest relative difference of the values they share."""
    keys = sorted(k for k in set(a) | set(b) if not k.startswith(MEASURED))
    mismatched = [k for k in keys if set(a.get(k, {})) != set(b.get(k, {}))]
    worst = 0.0
    for k in keys:
        for step, x in a.get(k, {}).items():
            y = b.get(k, {}).get(step)
            if y is not None and x != y:
                worst = max(worst, abs(x - y) / max(abs(x), abs(y), 1e-12))
    return mismatched, worst
