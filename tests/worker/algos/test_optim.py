"""AdamW with float32 master weights: bf16 parameters keep the updates bf16 alone would round away, float32
parameters step exactly as torch's AdamW, and a saved state resumes exactly."""

import io

import torch

from tests.numerics import assert_close
from worker.algos.optim import MasterWeightsAdamW

ADAMW = dict(lr=1e-5, betas=(0.9, 0.999), weight_decay=0.01)


def _params(dtype: torch.dtype, n: int = 512) -> tuple[torch.nn.Parameter, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=g, dtype=torch.float64) * 0.05  # a decoder weight's scale
    return torch.nn.Parameter(w.to(dtype)), w


def _steps(opt: torch.optim.Optimizer, p: torch.nn.Parameter, k: int, seed: int = 1) -> None:
    """k steps down a fixed direction with 10% noise (each moves a weight by about lr, as training does), the
    same bf16-rounded gradients whatever the parameter's dtype."""
    g = torch.Generator().manual_seed(seed)
    direction = torch.randn(p.shape, generator=g, dtype=torch.float64)
    for _ in range(k):
        grad = direction + 0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64)
        p.grad = grad.to(torch.bfloat16).to(p.dtype)
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_bf16_weights_move_with_a_float32_master_where_plain_adamw_leaves_them():
    plain, w0 = _params(torch.bfloat16)
    master, _ = _params(torch.bfloat16)
    reference = torch.nn.Parameter(w0.to(torch.bfloat16).double())  # the same run in float64
    _steps(torch.optim.AdamW([plain], **ADAMW), plain, 30)
    opt = MasterWeightsAdamW([master], **ADAMW)
    _steps(opt, master, 30)
    _steps(torch.optim.AdamW([reference], **ADAMW), reference, 30)
    start = w0.to(torch.bfloat16)
    moved_plain = float((plain.detach() != start).float().mean())
    moved_master = float((master.detach() != start).float().mean())
    # each step's ~1e-5 is under half a bf16 spacing for a weight above ~0.005; 30 of them are not
    assert moved_plain < 0.35 and moved_master > 0.6, (moved_plain, moved_master)
    # the master is the float64 run's weights to float32 accuracy, and the parameter is it rounded once
    state = opt.state[master]
    assert_close(state["master"], reference, dtype=torch.float32, terms=30)  # a rounding per step
    assert torch.equal(master.detach(), state["master"].to(torch.bfloat16))
    err_plain = float((plain.detach().double() - reference.detach()).abs().mean())
    err_master = float((master.detach().double() - reference.detach()).abs().mean())
    assert err_master < err_plain / 2, (err_master, err_plain)
    assert master.dtype == torch.bfloat16


def test_float32_parameters_step_exactly_as_torch_adamw():
    a, _ = _params(torch.float32)
    b, _ = _params(torch.float32)
    _steps(torch.optim.AdamW([a], **ADAMW), a, 5)
    opt = MasterWeightsAdamW([b], **ADAMW)
    _steps(opt, b, 5)
    assert torch.equal(a, b) and "master" not in opt.state[b]


def test_a_saved_state_resumes_exactly_with_float32_master_and_moments():
    straight, _ = _params(torch.bfloat16)
    opt = MasterWeightsAdamW([straight], **ADAMW)
    _steps(opt, straight, 3)
    buf = io.BytesIO()  # a round trip through bytes, as a checkpoint takes it
    torch.save(opt.state_dict(), buf)
    resumed = torch.nn.Parameter(straight.detach().clone())
    again = MasterWeightsAdamW([resumed], **ADAMW)
    again.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    state = again.state[resumed]
    assert state["master"].dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert torch.equal(state["master"], opt.state[straight]["master"])
    _steps(opt, straight, 4, seed=2)
    _steps(again, resumed, 4, seed=2)
    assert torch.equal(straight, resumed) and resumed.dtype == torch.bfloat16
