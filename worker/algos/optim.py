"""AdamW with float32 master weights for parameters stored in bfloat16 or float16.

A bf16 weight has 8 bits of mantissa: an update smaller than half its spacing (|w| * 2**-8) rounds away.
AdamW's first step moves every weight by about lr, so at lr 1e-5 a weight above ~0.005 in magnitude does not
move at all: on SmolLM2-135M in bf16, one full fine-tuning step changed 1.9% of its weights. This keeps a
float32 copy of each such parameter (and AdamW's moments, in float32) in the optimizer's state, steps the
copy, and rounds it into the parameter; updates accumulate in the copy until they show. Forwards and
backwards keep the parameter's dtype, so the log-probs are the bf16 model's. Parameters already in float32
(a LoRA adapter: peft keeps it in float32 over a bf16 model) are stepped as plain AdamW, bit for bit.

Memory per low-precision parameter: its 2 bytes and its gradient's 2, plus 4 (master) and 8 (moments) in
the state: 16 bytes, as float32 training takes, where plain bf16 AdamW would take 8 and lose the updates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


class MasterWeightsAdamW(torch.optim.AdamW):
    """torch.optim.AdamW, whose step on a bf16/fp16 parameter is taken on a float32 master copy kept in the
    parameter's state (`state[p]["master"]`), then rounded to nearest into the parameter."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p.dtype not in LOW_PRECISION:
                    continue
                # the first step's master is the parameter itself; it joins the state after that step, since
                # AdamW creates its moments (in float32, like the master) only for a parameter with no state
                master = self.state[p].get("master")
                grad, low = p.grad, p.data
                p.grad = None  # a parameter's grad must match its dtype while its data is swapped
                p.data = p.detach().to(torch.float32) if master is None else master  # [same shape as p]
                p.grad = grad.to(torch.float32)
                swapped.append((p, low))
        loss = super().step(closure)
        for p, low in swapped:
            self.state[p]["master"] = p.data
            low.copy_(p.data)  # round to nearest into the stored dtype
            grad = p.grad
            p.grad = None
            p.data = low
            p.grad = None if grad is None else grad.to(low.dtype)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As AdamW's, except that a low-precision parameter's master and moments stay float32: torch's own
        load casts every state tensor to its parameter's dtype, which would round them to bf16."""
        params = [p for group in self.param_groups for p in group["params"]]  # the saved ids, in order
        if not any(p.dtype in LOW_PRECISION for p in params):  # (FSDP's loader keys the state by name)
            return super().load_state_dict(state_dict)
        saved = {i: {k: v for k, v in s.items() if k != "step" and torch.is_tensor(v)}
                 for i, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        for i, values in saved.items():
            p = params[i]
            if p.dtype in LOW_PRECISION:
                self.state[p].update({k: v.to(device=p.device, dtype=torch.float32) for k, v in values.items()})
