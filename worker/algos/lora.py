"""Where a model's LoRA weights are: the one place that knows how peft lays them out."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class LoraLayer(NamedTuple):
    """One adapted linear layer: o = base(x) + scaling * B(A(dropout(x)))."""

    name: str  # the module's qualified name
    module: Any  # the peft layer (its attributes are peft's, untyped): .base_layer holds W0
    a: torch.nn.Linear  # A: [r, d_in]
    b: torch.nn.Linear  # B: [d_out, r]
    scaling: float


def is_lora(model: torch.nn.Module) -> bool:
    """A peft model: its trained weights are an adapter over a frozen base."""
    return hasattr(model, "peft_config")


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (the model itself without one)."""
    # nn.Module's __getattr__ types any attribute as a Tensor or a Module; peft's wrapper has this method
    return model.get_base_model() if is_lora(model) else model  # type: ignore[operator]


def lora_layers(model: torch.nn.Module, adapter: str = "default") -> list[LoraLayer]:
    """Every LoRA layer of the model's `adapter` (empty for a model without one)."""
    out = []
    for name, m in model.named_modules():
        a, b = getattr(m, "lora_A", None), getattr(m, "lora_B", None)
        if isinstance(a, torch.nn.ModuleDict) and isinstance(b, torch.nn.ModuleDict) and adapter in a:
            a_, b_ = a[adapter], b[adapter]
            if isinstance(a_, torch.nn.Linear) and isinstance(b_, torch.nn.Linear):
                out.append(LoraLayer(name, m, a_, b_, float(m.scaling[adapter])))
    return out
