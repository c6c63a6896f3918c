"""The tinker SDK's request bodies as the API validates them and the worker reads them back: an
operation is stored as its request's JSON and parsed again with the same model, so both sides share
one set of fields and defaults (service/api/tinker/ answers; worker/loops/session*.py runs them)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_K = 64  # widest top-k and most alternative draws a position gets
MAX_CELLS = 1 << 21  # largest [positions, k] answer a field may hold (8 MiB of float32)


class Wire(BaseModel):
    """A request body as the SDK sends it. Fields a newer SDK adds are ignored, not refused: the SDK,
    not a person, writes these bodies, and it must keep working against this server."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class ClientConfigIn(Wire):
    sdk_version: str = Field("", max_length=40)


class CreateSessionIn(Wire):
    tags: list[Annotated[str, Field(max_length=100)]] = Field(default_factory=list, max_length=50)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = Field("", max_length=40)


class SessionIdIn(Wire):
    session_id: str = Field(max_length=40)


class LoraConfigIn(Wire):
    rank: int = Field(ge=1, le=1024)
    seed: int | None = Field(None, ge=0, le=2**32 - 1)
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelIn(Wire):
    session_id: str = Field(max_length=40)
    model_seq_id: int = Field(0, ge=0, le=2**31 - 1)
    base_model: str = Field(max_length=200)
    lora_config: LoraConfigIn | None = None
    user_metadata: dict[str, Any] | None = None


class ModelIdIn(Wire):
    model_id: str = Field(max_length=40)


class AdamParamsIn(Wire):
    learning_rate: float = Field(1e-4, ge=0, le=10)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0, le=1)
    weight_decay: float = Field(0.0, ge=0, le=10)
    grad_clip_norm: float = Field(0.0, ge=0)


class OptimStepIn(Wire):
    model_id: str = Field(max_length=40)
    seq_id: int | None = Field(None, ge=0, le=2**62)
    adam_params: AdamParamsIn


class SaveForSamplerIn(Wire):
    model_id: str = Field(max_length=40)
    path: str | None = Field(None, max_length=200)
    sampling_session_seq_id: int | None = Field(None, ge=0, le=2**31 - 1)
    kind: str = Field("snapshot", max_length=20)
    seq_id: int | None = Field(None, ge=0, le=2**62)


class SaveWeightsIn(Wire):
    model_id: str = Field(max_length=100)
    path: str | None = Field(None, max_length=100, description="The checkpoint's name.")
    seq_id: int | None = Field(None, ge=0, le=2**62)


class LoadWeightsIn(Wire):
    model_id: str | None = Field(None, max_length=100)
    seq_id: int | None = Field(None, ge=0, le=2**62)
    session_id: str | None = Field(None, max_length=40)
    model_seq_id: int | None = Field(None, ge=0, le=2**31 - 1)
    base_model: str | None = Field(None, max_length=200)
    path: str = Field(max_length=300)
    optimizer: bool = False


class CreateSamplingSessionIn(Wire):
    session_id: str = Field(max_length=40)
    sampling_session_seq_id: int = Field(0, ge=0, le=2**31 - 1)
    base_model: str | None = Field(None, max_length=200)
    model_path: str | None = Field(None, max_length=300)


class TextChunkIn(Wire):
    type: str = Field("encoded_text", max_length=30)
    tokens: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] = Field(default_factory=list, max_length=131072)


class PromptIn(Wire):
    chunks: list[TextChunkIn] = Field(min_length=1, max_length=1024)


class SamplingParamsIn(Wire):
    max_tokens: int | None = Field(None, ge=1, le=8192)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[Annotated[str, Field(max_length=200)]] | list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None \
        = Field(None, max_length=64)
    temperature: float = Field(1.0, ge=0, le=100)
    top_k: int = Field(-1, ge=-1, le=2**31 - 1)
    top_p: float = Field(1.0, gt=0, le=1)


class TensorIn(Wire):
    """A tensor as the SDK's JSON sends it (`TensorData`): flat values, dense or sparse CSR."""

    data: list[float] = Field(max_length=MAX_CELLS)
    dtype: str = Field(max_length=20)
    shape: list[Annotated[int, Field(ge=0, le=MAX_CELLS)]] | None = Field(None, max_length=8)
    sparse_crow_indices: list[Annotated[int, Field(ge=0, le=MAX_CELLS)]] | None = Field(None, max_length=131073)
    sparse_col_indices: list[Annotated[int, Field(ge=0, le=MAX_CELLS)]] | None = Field(None, max_length=MAX_CELLS)


class SampleIn(Wire):
    sampling_session_id: str = Field(max_length=100)
    seq_id: int | None = Field(None, ge=0, le=2**62)
    num_samples: int = Field(1, ge=1, le=256)
    prompt: PromptIn
    sampling_params: SamplingParamsIn
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = Field(0, ge=0, le=MAX_K, description="The k likeliest tokens at each prompt position.")
    topk_sample_logprobs: int = Field(0, ge=0, le=MAX_K, description="The k likeliest tokens at each sampled "
                                      "position.")
    prompt_alt_tokens_k: int = Field(0, ge=0, le=MAX_K, description="Tokens drawn at each prompt position after "
                                     "the first.")
    target_prompt_logprobs: TensorIn | None = Field(None, description="Token ids to score, [len(prompt) - 1, K], "
                                                    "-1 for none; dense or sparse CSR.")
    prompt_logprobs_last_n: int | None = Field(None, ge=1, le=131072, description="Score only the last n prompt "
                                               "tokens.")


class RetrieveFutureIn(Wire):
    request_id: str = Field(max_length=40)
    allow_metadata_only: bool = False


class SaveNamedOp(BaseModel):
    """A `save_weights` operation's body: the run's state (`weights`) or weights to sample from
    (`sampler_weights`) under a name, as `tinker://<model_id>/<kind>/<name>`."""

    kind: Literal["weights", "sampler_weights"]
    name: str


class LoadWeightsOp(BaseModel):
    """A `load_weights` operation's body: the checkpoint `path` names (run `job`, its step), with the
    optimizer state or not."""

    job: int
    step: int
    path: str
    optimizer: bool
