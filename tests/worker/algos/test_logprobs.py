"""Chunked token log-probs against the full-logits formula, values and gradients."""

import copy

import pytest
import torch

from tests.numerics import assert_close
from worker.algos.logprobs import Float32Head, chunk_positions, token_logprobs


def _reference(h, w, b, targets, temperature):
    z = torch.nn.functional.linear(h, w, b).float() / temperature  # [M, V]
    logp = torch.log_softmax(z, -1)
    return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def _inputs(dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    M, H, V = 9, 6, 13
    h = torch.randn(M, H, generator=g, dtype=dtype).requires_grad_(True)
    w = torch.randn(V, H, generator=g, dtype=dtype).requires_grad_(True)
    b = torch.randn(V, generator=g, dtype=dtype).requires_grad_(True) if bias else None
    return h, w, b, torch.randint(0, V, (M,), generator=g)


def test_hand_computed_two_token_vocabulary():
    # V = 2, H = 1: logits (h*w0, h*w1) = (2, 0) at position 0 and (0, 0) at position 1
    h = torch.tensor([[1.0], [0.0]], requires_grad=True)
    w = torch.tensor([[2.0], [0.0]], requires_grad=True)
    logp, ent = token_logprobs(h, w, None, torch.tensor([0, 1]), with_entropy=True, chunk=1)
    p0 = 1 / (1 + torch.exp(torch.tensor(-2.0)))  # softmax(2, 0)[0]
    torch.testing.assert_close(logp, torch.stack([p0.log(), torch.tensor(0.5).log()]))
    torch.testing.assert_close(ent[1], torch.tensor(2.0).log())  # uniform over 2
    logp.sum().backward()
    # position 0, target 0: d logp / d z = (1 - p0, -(1 - p0)), and dz/dh = w = (2, 0): 2 (1 - p0)
    # position 1, target 1: d logp / d z = (-1/2, 1/2): -1
    torch.testing.assert_close(h.grad, torch.stack([2 * (1 - p0), torch.tensor(-1.0)])[:, None])


@pytest.mark.parametrize("chunk", [1, 4, 9, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradcheck_in_float64(chunk, temperature):
    h, w, b, t = _inputs(torch.float64)
    assert torch.autograd.gradcheck(
        lambda h, w, b: token_logprobs(h, w, b, t, temperature=temperature, chunk=chunk)[0], (h, w, b))


@pytest.mark.parametrize("bias", [True, False])
def test_values_entropy_and_gradients_match_the_full_logits(bias):
    h, w, b, t = _inputs(torch.float32, bias=bias)
    logp, ent = token_logprobs(h, w, b, t, temperature=0.8, with_entropy=True, chunk=4)
    want, want_ent = _reference(h, w, b, t, 0.8)
    torch.testing.assert_close(logp, want)
    torch.testing.assert_close(ent, want_ent.detach())
    upstream = torch.randn(len(t), generator=torch.Generator().manual_seed(1))
    mine = torch.autograd.grad((logp * upstream).sum(), [x for x in (h, w, b) if x is not None])
    theirs = torch.autograd.grad((want * upstream).sum(), [x for x in (h, w, b) if x is not None])
    for a, c in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, c)


def test_bfloat16_weights_keep_their_dtype_and_softmax_in_float32():
    h, w, b, t = _inputs(torch.bfloat16)
    logp, _ = token_logprobs(h, w, b, t, chunk=2)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, _reference(h, w, b, t, 1.0)[0])
    logp.sum().backward()
    assert h.grad.dtype == w.grad.dtype == b.grad.dtype == torch.bfloat16


def test_only_what_needs_a_gradient_gets_one():
    h, w, b, t = _inputs(torch.float32)
    w.requires_grad_(False)
    b.requires_grad_(False)
    token_logprobs(h, w, b, t)[0].sum().backward()
    assert h.grad is not None and w.grad is None and b.grad is None


def test_chunk_size_bounds_the_logits():
    assert chunk_positions(49_152) == 341  # 64 MiB of float32 logits at SmolLM2's vocabulary
    assert chunk_positions(10**9) == 1


def test_a_float32_head_over_bfloat16_weights_runs_its_matmul_in_float32():
    h, w, b, t = _inputs(torch.bfloat16)
    logp, _ = token_logprobs(h, w, b, t, chunk=2, head_dtype=torch.float32)
    want = _reference(h.float(), w.float(), b.float(), t, 1.0)[0]  # the same bf16 values, multiplied in fp32
    assert_close(logp, want, dtype=torch.float32, terms=h.shape[1])
    assert not torch.equal(logp, _reference(h, w, b, t, 1.0)[0])  # a bf16 matmul rounds the logits
    mine = torch.autograd.grad(logp.sum(), [h, w, b])
    theirs = torch.autograd.grad(want.sum(), [h, w, b])  # autograd through the casts: fp32 maths, bf16 grads
    for a, c in zip(mine, theirs, strict=True):
        assert a.dtype == torch.bfloat16
        assert_close(a, c, dtype=torch.bfloat16)


def test_a_float32_head_shares_its_tied_weights_and_casts_again_after_an_update():
    g = torch.Generator().manual_seed(0)
    embed = torch.nn.Embedding(13, 6).to(torch.bfloat16)
    linear = torch.nn.Linear(6, 13, bias=False).to(torch.bfloat16)
    linear.weight = embed.weight  # tied, as SmolLM2's head is
    head = Float32Head.wrap(linear)
    assert head.weight is embed.weight and head.state_dict().keys() == linear.state_dict().keys()
    x = torch.randn(3, 6, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        y = head(x)
        assert y.dtype == torch.float32
        assert_close(y, torch.nn.functional.linear(x.float(), embed.weight.float()), terms=6)
        embed.weight.add_(1.0)  # an optimizer step or a sync: the kept float32 copy is stale
        assert_close(head(x), torch.nn.functional.linear(x.float(), embed.weight.float()), terms=6)
    assert head._cast is not None and copy.deepcopy(head)._cast is None  # a copy casts its own weights
    head(x).sum().backward()  # a training forward reaches the weights themselves
    assert embed.weight.grad is not None and embed.weight.grad.dtype == torch.bfloat16
    embed.weight.requires_grad_(False)  # frozen (LoRA): a training forward reuses the cast, the input's gradient flows
    x.requires_grad_(True)
    cast = head._cast
    head(x).sum().backward()
    assert head._cast is cast and x.grad is not None
