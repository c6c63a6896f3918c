"""TracIn influence over LoRA weights with "ghost" inner products (no per-sample gradients).

For a LoRA layer `o = B(A(x')) * s` (x' = dropout(x)), with h = x' A^T and g_h, g_o the gradients
at A's and B's outputs that backward sees (g_o already carries s):

    grad_A = sum_t g_h[t]^T x'[t]        grad_B = sum_t g_o[t]^T h[t]

so for fixed validation gradients G_A [r, d_in] and G_B [d_out, r] of the same layer,

    <grad_A(i), G_A> = sum_t <g_h[i, t], x'[i, t] G_A^T>      <grad_B(i), G_B> = sum_t <g_o[i, t] G_B, h[i, t]>

Both are computed per sample from rank-r projections inside one batched backward (a sample's
gradient at its own positions comes from its own loss only), at O(T * r * d) per layer.

`GhostHooks(keep_factors=True)` instead contracts each layer's factors over tokens inside the
same backward, into every sample's rank-r LoRA gradients (g_h^T x' [r, d_in], g_o^T h [d_out, r]),
and takes the score from them (<g_h^T x', G_A>, O(r * d) per sample once contracted). They let the
gradient of any weighted subset be recovered without a second backward, and `fold` adds a
micro-batch's selected samples into that gradient and frees their factors at once, so with a
per-sample rule (`positive`) they never outlive their micro-batch. Kept for a whole batch they
take N * r * (d_in + d_out) floats per layer (the size of N LoRA gradients).

Scores in AdamW's geometry (`adam_direction`, `GhostHooks.rescore`). The update AdamW makes from the
batch gradient gbar = sum_i w_i g_i (w_i = 1: sample i's weight in the batch loss), with the moments
m, v it holds before step t, a_t = (1 - b1) / (1 - b1^t), b_t = (1 - b2) / (1 - b2^t):

    m_hat = m / (1 - b1^t) * b1 + a_t * gbar      v_hat = v / (1 - b2^t) * b2 + b_t * gbar^2
    delta = -lr * (m_hat / u + wd * theta)        u = sqrt(v_hat) + eps

so, to first order in w_i, the validation objective moves by
    d L_val / d w_i = <G_val, d delta / d w_i> = -lr * <g_i, D_t * G_val>,
    D_t = a_t / u - b_t * m_hat * gbar / (sqrt(v_hat) * u^2)
(elementwise; the decay term does not depend on w_i). The score <g_i, D_t * G_val> is read like the
SGD one, <g_i, G_val>: positive helps. Dropping D_t's second term (the moments held fixed) gives the
preconditioned score LESS (Xia et al. 2024) selects with. D_t needs gbar, known only once the whole
batch's backward has run, so these scores are taken from the kept per-sample factors afterwards.
On the first step (m = v = 0) D_1 ~ 0 where |gbar| >> eps: Adam's first step is a sign step, which
no one sample's weight changes. With gbar^2 in v_hat replaced by its running estimate v / (1 - b2^(t-1)),
v_hat is exactly that estimate (b2 v + (1 - b2) v / (1 - b2^(t-1)) = (1 - b2^t) v / (1 - b2^(t-1))), and
the fixed-moments D_t becomes a_t / u_{t-1}: AdamW's preconditioner as the moments before the step have it,
known before the batch's backward, so those scores stream like the SGD ones (`moments="prior"`).

Shared prompts (`SharedPrompt`, worker/model/prefix.py). Where a group's rows share their prompt's
forward, the hooks see only the completions' positions, row by row; each row reads its prompt's keys,
values and last hidden state from leaves y_i of its own. The prompt's positions add to <grad L_i, X>

    <dL_i/dy_i, J_u X>        J_u X: the derivative of prompt u's outputs along X (forward-mode, U rows)

and to the gradient of a weighted subset  J_u^T (sum_{i in u} w_i dL_i/dy_i)  (one backward of the
prompts), so scores, rescoring and `fold` stay exact, and the prompts' positions run once per group.
Where scores are read and folded micro-batch by micro-batch along a direction known before the backward,
both passes run once for the step's prompts (`_Ahead`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, Protocol, Self

import torch

from worker.algos.lora import lora_layers


class SharedPrompt(Protocol):
    """A micro-batch's distinct prompts, run once, and its rows' leaves (worker/model/prefix.PromptPart)."""

    @property
    def inverse(self) -> torch.Tensor: ...  # [n] each row's prompt

    @property
    def leaves(self) -> list[torch.Tensor]: ...  # per row [n, ...]: after backward, .grad is that row's own

    def outputs(self) -> list[torch.Tensor]: ...  # the prompts' outputs [U, ...], in a graph

    def tangents(self, directions: dict[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]: ...

    def chunks(self, size: int) -> list[tuple[slice, Self]]: ...

    def merged(self, parts: list[Self], grads: list[list[torch.Tensor | None]]
               ) -> tuple[Self, list[torch.Tensor | None]]: ...  # many parts as one, and their rows' grads

    @property
    def width(self) -> int: ...  # P: the prompts' positions, left-padded (the keys' and values' dim -2)

    def keys(self) -> list[tuple[int, ...]]: ...  # each distinct prompt's real tokens

    def of(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Self: ...  # rows' [n, P] distinct prompts, no leaves


@dataclass
class _Prompt:
    """A shared prompt's part in the scores: its rows among the batch's, and each leaf's per-row gradient."""

    rows: torch.Tensor  # [n]
    part: SharedPrompt
    grads: list[torch.Tensor | None]  # per leaf [n, ...]


def _prompt_sums(p: _Prompt, w: torch.Tensor, u: int) -> list[torch.Tensor | None]:
    """Per leaf, p's rows' gradients weighted by w [n], each summed into its prompt's: [u, ...] (None: no grad)."""
    return [None if g is None else torch.zeros(u, *g.shape[1:], dtype=g.dtype, device=g.device).index_add_(
        0, p.part.inverse, g * w.to(g.device, g.dtype).view(-1, *[1] * (g.dim() - 1))) for g in p.grads]


def _window(leaves: list[torch.Tensor], width: int) -> list[torch.Tensor]:
    """Views of every keys' and values' leaf [U, h, P, d] at its last `width` positions (left padding puts a
    prompt's tokens last); the last leaf, the hidden state, whole."""
    return [x[..., x.shape[-2] - width:, :] for x in leaves[:-1]] + leaves[-1:]


@dataclass
class _Ahead:
    """A step's distinct prompts as one part. Where micro-batches are scored and folded as each ends, what they
    need of their prompts is taken in one pass of all: the derivative along the streamed direction before the
    first is scored, one backward with every folded row's weighted gradient after the last (a pass costs
    mostly per layer and call, so one of U prompts costs about what one of a micro-batch's does)."""

    part: SharedPrompt
    index: dict[tuple[int, ...], int]  # a prompt's real tokens -> its row in `part`
    tangents: list[torch.Tensor] | None = None  # per leaf [U, ...] along the streamed direction
    cotangents: list[torch.Tensor | None] | None = None  # per leaf [U, ...] sum over folded rows of w_i dL_i/dy_i

    def rows(self, p: _Prompt) -> torch.Tensor:
        """[u] where `p`'s distinct prompts are among the step's."""
        return torch.tensor([self.index[k] for k in p.part.keys()], device=p.part.inverse.device)

    def tangents_of(self, p: _Prompt) -> list[torch.Tensor]:
        """The tangents of `p`'s prompts [u, ...], laid out as its part's."""
        assert self.tangents is not None
        at = self.rows(p)
        return _window([t[at] for t in self.tangents], p.part.width)

    def add_cotangents(self, p: _Prompt, w: torch.Tensor) -> None:
        """Sum `p`'s rows' gradients, weighted by w [n], into their prompts' cotangents."""
        at, last = self.rows(p), len(p.grads) - 1
        width, wide = p.part.width, self.part.width
        if self.cotangents is None:
            self.cotangents = [None] * len(p.grads)
        for j, per in enumerate(_prompt_sums(p, w, len(at))):  # [u, ...]
            if per is None:
                continue
            c = self.cotangents[j]
            if c is None:  # keys and values [U, h, P, d] at the step's width; the hidden state [U, 1, H]
                shape = [*per.shape[1:-2], wide, per.shape[-1]] if j < last else list(per.shape[1:])
                c = self.cotangents[j] = torch.zeros(len(self.index), *shape, dtype=per.dtype, device=per.device)
            (c[..., wide - width:, :] if j < last else c).index_add_(0, at, per)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[N, ..., d] -> [N, L, d]."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


Moments = Literal["batch", "fixed", "prior"]


def adam_direction(val_grad: torch.Tensor, batch_grad: torch.Tensor | None, exp_avg: torch.Tensor | None,
                   exp_avg_sq: torch.Tensor | None, *, step: int, betas: tuple[float, float], eps: float,
                   moments: Moments = "batch") -> torch.Tensor:
    """D_t * G_val for one parameter (every tensor of its shape), in float64.

    val_grad G_val; batch_grad gbar, the gradient AdamW's step `step` (1-based) will see (after
    clipping); exp_avg m, exp_avg_sq v: AdamW's moments before that step (None: no step taken yet).
    moments: "batch" D_t itself; "fixed" drops D_t's second term (v_hat held fixed in w_i: the LESS
    preconditioner); "prior" is a_t / u with v_hat from the moments before the step alone,
    v / (1 - b2^(t-1)): the v_hat AdamW would use were gbar^2 equal to its running estimate, so it needs
    no gbar (batch_grad may be None) and is known before the batch's backward (from step 2)."""
    b1, b2 = betas
    c1, c2 = 1 - b1 ** step, 1 - b2 ** step
    a_t, b_t = (1 - b1) / c1, (1 - b2) / c2
    if moments == "prior":
        if exp_avg_sq is None or step < 2:
            raise ValueError("the prior-moments direction needs AdamW's moments from an earlier step")
        u = (exp_avg_sq.double() / (1 - b2 ** (step - 1))).sqrt() + eps
        return a_t / u * val_grad.double()
    if batch_grad is None:
        raise ValueError(f"the {moments!r} direction needs the batch's gradient")
    gbar = batch_grad.double()
    m = torch.zeros_like(gbar) if exp_avg is None else exp_avg.double()
    v = torch.zeros_like(gbar) if exp_avg_sq is None else exp_avg_sq.double()
    m_hat = b1 * m / c1 + a_t * gbar  # = (b1 m + (1 - b1) gbar) / (1 - b1^t), AdamW's own
    v_hat = b2 * v / c2 + b_t * gbar * gbar
    root = v_hat.sqrt()
    u = root + eps
    d = a_t / u
    if moments == "batch":  # where v_hat = 0, gbar = 0 too: the term is 0
        d = d - torch.where(root > 0, b_t * m_hat * gbar / (root.clamp_min(torch.finfo(root.dtype).tiny) * u * u), 0.0)
    return d * val_grad.double()


class GhostHooks:
    """Per-sample inner products with a fixed validation gradient, accumulated during backward.

    Usage:
        with GhostHooks(model) as gh:
            val_loss().backward(); gh.capture_validation_gradient()   # G per layer; grads zeroed
            gh.place(torch.arange(N)); train_losses().sum().backward()
        gh.scores  # [N]
    `place` each micro-batch's rows before its backward to put its samples in `scores`.
    """

    def __init__(self, model: torch.nn.Module, *, keep_factors: bool = False) -> None:
        self.layers = lora_layers(model)
        if not self.layers:
            raise ValueError("the model has no LoRA layers: influence is computed over LoRA weights")
        self.keep_factors = keep_factors
        self.val_grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.streamed: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # scored against (None: val_grads)
        self._scores: torch.Tensor | None = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, one layer's [n] contribution)
        self.rows: torch.Tensor | None = None
        self.factors: list[tuple[int, torch.Tensor, str, torch.Tensor]] = []  # (layer, rows, "A"/"B", per-sample grad)
        self.subset: dict[torch.Tensor, torch.Tensor] = {}  # folded subset gradient per LoRA weight
        self.prompts: list[_Prompt] = []  # shared prompts, kept with the factors (or until scored)
        self._unscored: list[_Prompt] = []  # those not yet in `scores`: scored together when they are read
        self._step_prompts: tuple[torch.Tensor, torch.Tensor] | None = None  # every row's prompt [N, P] and mask
        self._ahead: _Ahead | None = None  # the step's prompts as one part, once a micro-batch's are met
        self._paused = False
        self._widest = 0  # the most positions a hooked micro-batch ran (rows x length): what a backward may hold
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> GhostHooks:
        for i, layer in enumerate(self.layers):
            a, b = layer.a, layer.b
            self._handles.append(a.register_forward_hook(self._hook(i, "A")))
            self._handles.append(b.register_forward_hook(self._hook(i, "B")))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def capture_validation_gradient(self) -> None:
        """Take the accumulated .grad of every LoRA A and B as the validation direction, then zero it."""
        for i, layer in enumerate(self.layers):
            a, b = layer.a, layer.b
            if a.weight.grad is None or b.weight.grad is None:
                raise RuntimeError("no validation gradient: call backward on the validation loss first")
            self.val_grads[i] = (a.weight.grad.detach().clone(), b.weight.grad.detach().clone())
            a.weight.grad = None
            b.weight.grad = None

    def _hook(self, i: int, which: str) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor], None]:
        def forward_hook(_module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            if i not in self.val_grads or not output.requires_grad or self._paused:
                return  # validation pass (or no grad, or a prompts' backward for `fold`): nothing to score
            inp = _flat(inputs[0].detach())  # A: x' [N, L, d_in];  B: h [N, L, r]
            self._widest = max(self._widest, inp.shape[0] * inp.shape[1])
            rows = self.rows if self.rows is not None else torch.arange(inp.shape[0])
            g_a, g_b = (self.streamed or self.val_grads)[i]
            if self.keep_factors:
                val_grad = (g_a if which == "A" else g_b).to(inp.dtype).reshape(-1)  # A: [r*d_in];  B: [d_out*r]
                held = [inp]
            else:  # A: project the input now ([N, L, r]); B: keep h ([N, L, r]) and project the gradient later
                held = [inp @ g_a.T.to(inp.dtype) if which == "A" else inp]

            # Few, fused ops per call: with hundreds of LoRA layers and small micro-batches the
            # hooks' cost is their number of kernel launches, not their arithmetic.
            def backward_hook(grad: torch.Tensor) -> None:
                g = _flat(grad.detach())  # A: g_h [N, L, r];  B: g_o [N, L, d_out]
                n = g.shape[0]
                # Let go of the activation now: autograd frees its own copy as backward passes the
                # layer, and one held to the end of the micro-batch keeps the allocator from reusing it.
                x = held.pop()
                if self.keep_factors:
                    per = torch.bmm(g.transpose(1, 2), x)  # A: g_h^T x' [N, r, d_in];  B: g_o^T h [N, d_out, r]
                    contrib = per.reshape(n, -1) @ val_grad  # [N]: <grad_i, G> for this layer's factor
                    self.factors.append((i, rows, which, per))
                elif which == "A":
                    contrib = torch.linalg.vecdot(g.reshape(n, -1), x.reshape(n, -1))  # sum_t <g_h, x' G_A^T>
                else:
                    contrib = torch.linalg.vecdot((g @ g_b.to(g.dtype)).reshape(n, -1), x.reshape(n, -1))  # sum_t <g_o G_B, h>
                self._pending.append((rows, contrib))

            output.register_hook(backward_hook)

        return forward_hook

    def _along(self, directions: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> dict[torch.Tensor, torch.Tensor]:
        return {w: d for i, layer in enumerate(self.layers) for w, d in zip((layer.a.weight, layer.b.weight), directions[i])}

    def add_prompt(self, part: SharedPrompt) -> None:
        """Keep what `part`'s prompts add to the rows of the micro-batch just backpropagated (`place`d
        before it): scored against G_val when `scores` is next read (all parts in one forward-mode pass,
        none if `rescore` comes first), kept with the factors for `rescore` and `fold`."""
        if self.rows is None:
            raise RuntimeError("place the micro-batch's rows before its shared prompts")
        grads = [None if leaf.grad is None else leaf.grad.detach() for leaf in part.leaves]
        part.leaves.clear()  # the values are not needed again: only their gradients
        kept = _Prompt(self.rows, part, grads)
        self.prompts.append(kept)
        self._unscored.append(kept)

    @staticmethod
    def _merged(prompts: list[_Prompt]) -> _Prompt:
        """Several parts as one: their prompts in one forward (a pass's cost is mostly per layer and call)."""
        if len(prompts) == 1:
            return prompts[0]
        part, grads = prompts[0].part.merged([p.part for p in prompts], [p.grads for p in prompts])
        return _Prompt(torch.cat([p.rows for p in prompts]), part, grads)

    @staticmethod
    def _prompt_scores(p: _Prompt, tangents: list[torch.Tensor]) -> torch.Tensor:
        """[n] float64: <dL_i/dy_i, J_u X> over the part's leaves, from its prompts' tangents J_u X [u, ...]."""
        n = len(p.rows)
        total = torch.zeros(n, dtype=torch.float64, device=p.part.inverse.device)
        for g, t in zip(p.grads, tangents):
            if g is not None:
                total += torch.linalg.vecdot(g.reshape(n, -1).double(), t[p.part.inverse].reshape(n, -1).double())
        return total

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No scoring in here (a backward of the prompts for `fold`)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    @property
    def scores(self) -> torch.Tensor:
        """[N] float64 influence of every training row scored so far."""
        if self._scores is None:
            raise RuntimeError("no scores before start_scoring")
        if self._pending:  # one sum per micro-batch instead of one scatter per layer
            by_rows: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
            for rows, c in self._pending:
                by_rows.setdefault(id(rows), (rows, []))[1].append(c)
            for rows, parts in by_rows.values():
                total = torch.stack(parts).to(self._scores.device, torch.float64).sum(0)  # [n]
                self._scores.index_add_(0, rows.to(self._scores.device), total)
            self._pending.clear()
        if self._unscored:
            directions = self._along(self.streamed or self.val_grads)
            ahead = self._ahead_of(self._unscored[0])
            if ahead is not None:  # each part's prompts from the step's, differentiated once
                if ahead.tangents is None:
                    ahead.tangents = ahead.part.tangents(directions)
                with_tangents = [(p, ahead.tangents_of(p)) for p in self._unscored]
            else:  # all parts merged into one pass
                m = self._merged(self._unscored)
                with_tangents = [(m, m.part.tangents(directions))]
            for p, tangents in with_tangents:
                self._scores.index_add_(0, p.rows.to(self._scores.device),
                                        self._prompt_scores(p, tangents).to(self._scores.device))
            self._unscored.clear()
            if not self.keep_factors:
                self.prompts.clear()
        return self._scores

    def rescore(self, directions: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """[N] float64 <grad_i, X> over every kept sample, for other per-layer directions X (A's and
        B's, like val_grads: an AdamW-preconditioned G_val). The scores become these; val_grads
        stay G_val. Needs every sample's factors (before `fold`)."""
        if not self.keep_factors:
            raise RuntimeError("GhostHooks(keep_factors=True) is needed to rescore against another direction")
        if self._scores is None:
            raise RuntimeError("no scores before start_scoring")
        self._pending.clear()
        self._scores.zero_()
        for i, rows, which, per in self.factors:
            x = directions[i][0 if which == "A" else 1].reshape(-1).to(per.device, torch.float64)  # [r*d_in] | [d_out*r]
            self._scores.index_add_(0, rows.to(self._scores.device), (per.reshape(per.shape[0], -1).double() @ x)
                                    .to(self._scores.device))
        self._unscored.clear()
        if self.prompts:
            p = self._merged(self.prompts)
            self._scores.index_add_(0, p.rows.to(self._scores.device),
                                    self._prompt_scores(p, p.part.tangents(self._along(directions)))
                                    .to(self._scores.device))
        return self._scores

    def start_scoring(self, n: int, device: torch.device | str,
                      along: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
                      prompts: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Score the `n` training rows whose forward and backward come next against per-layer directions
        `along` (A's and B's, like val_grads; None: G_val itself). `prompts`, their prompt ids and mask
        [n, P], where scores are read and folded micro-batch by micro-batch: their shared prompts are
        then differentiated all at once (`_Ahead`)."""
        self._scores = torch.zeros(n, dtype=torch.float64, device=device)
        self.streamed = along
        self._step_prompts = prompts
        self._pending.clear()
        self.release()

    def place(self, rows: torch.Tensor) -> None:
        """The training rows [n] of the micro-batch whose forward and backward come next."""
        self.rows = rows

    def subset_gradient(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The folded gradient of LoRA weight `p` (zeros where nothing selected touched it)."""
        ahead = self._ahead
        if ahead is not None and ahead.cotangents is not None:  # the folded rows' part of their shared prompts
            cotangents = ahead.cotangents
            ahead.cotangents = None
            self._add_to_subset(self._prompt_backward(ahead.part, cotangents))
        return self.subset.get(p, torch.zeros_like(p))

    def _ahead_of(self, p: _Prompt) -> _Ahead | None:
        """The step's prompts as one part (built with `p`'s decoder when first asked), or None: not asked for."""
        if self._ahead is None and self._step_prompts is not None:
            part = p.part.of(*self._step_prompts)
            self._ahead = _Ahead(part, {k: i for i, k in enumerate(part.keys())})
        return self._ahead

    def release(self) -> None:
        """Let go of the kept per-sample factors, shared prompts and the folded subset gradient."""
        self.factors.clear()
        self.prompts.clear()
        self._unscored.clear()
        self.subset.clear()
        self._ahead = None

    def fold(self, weights: torch.Tensor) -> None:
        """Add sum_i weights[i] * grad_i over the samples whose factors are kept to `subset` (one
        tensor per LoRA weight), then free those factors. weights: [N] over all training rows."""
        if not self.keep_factors:
            raise RuntimeError("GhostHooks(keep_factors=True) is needed to recover subset gradients")
        row_weights: dict[int, torch.Tensor | None] = {}  # per micro-batch: its rows' weights, None if all 0
        for i, rows, which, per in self.factors:
            if id(rows) not in row_weights:
                mine = weights[rows.to(weights.device)]
                row_weights[id(rows)] = mine.to(per.device, per.dtype) if bool(mine.any()) else None
            w = row_weights[id(rows)]  # [n]
            if w is None:
                continue  # nothing selected in this micro-batch
            layer = self.layers[i]
            p = layer.a.weight if which == "A" else layer.b.weight
            if p not in self.subset:
                self.subset[p] = torch.zeros(per.shape[1:], dtype=per.dtype, device=per.device)
            self.subset[p].view(-1).addmv_(per.reshape(per.shape[0], -1).T, w)  # += sum_i w_i grad_i
        self.factors.clear()
        ahead = self._ahead_of(self.prompts[0]) if self.prompts else None
        if ahead is not None:  # one backward of the step's prompts, when the subset gradient is read
            for q in self.prompts:
                mine = weights[q.rows.to(weights.device)]
                if bool(mine.any()):
                    ahead.add_cotangents(q, mine)
        elif self.prompts:
            self._add_to_subset(self._prompt_gradient(self._merged(self.prompts), weights))
        self.prompts.clear()
        self._unscored.clear()

    def _prompt_gradient(self, p: _Prompt, weights: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(LoRA weight, J_u^T (sum_{i in u} w_i dL_i/dy_i) over the part's prompts u): one backward of them."""
        w = weights[p.rows.to(weights.device)]
        if not bool(w.any()):
            return []
        return self._prompt_backward(p.part, _prompt_sums(p, w, len(p.part.keys())))

    def _prompt_backward(self, part: SharedPrompt, cotangents: list[torch.Tensor | None]
                         ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(LoRA weight, J_u^T c) for per-leaf cotangents c [U, ...] of `part`'s prompts (None: 0)."""
        params = [x for layer in self.layers for x in (layer.a.weight, layer.b.weight)]
        # prompts a few at a time, no more positions than a micro-batch's backward held: all of a step's at once
        # raised TracIn's peak memory by a quarter of a GB (SmolLM2-135M, 8 prompts)
        size = max(1, self._widest // max(1, part.width)) if self._widest else len(part.keys())
        total: list[torch.Tensor | None] = [None] * len(params)  # the chunks' sum, per weight (None: no gradient)
        for rows, chunk in part.chunks(size):
            with self.paused(), torch.enable_grad():
                outs = chunk.outputs()  # [u, ...]
                grads = torch.autograd.grad(outs, params, allow_unused=True, grad_outputs=[
                    torch.zeros_like(out) if c is None else c[rows].to(out.dtype) for c, out in zip(cotangents, outs)])
            total = [t if g is None else g if t is None else t + g for t, g in zip(total, grads)]
        return [(x, g) for x, g in zip(params, total) if g is not None]

    def _add_to_subset(self, grads: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for x, g in grads:
            if x not in self.subset:
                self.subset[x] = torch.zeros_like(g)
            self.subset[x] += g.to(self.subset[x].dtype)

    def complete_gradient(self, n: int) -> None:
        """Add the kept shared prompts' part of the whole batch's gradient (every one of its `n` rows with
        weight 1) to the LoRA weights' .grad, which the backward stopped at their leaves."""
        if not self.prompts:
            return
        for x, g in self._prompt_gradient(self._merged(self.prompts), torch.ones(n, dtype=torch.float64)):
            x.grad = g.to(x.dtype) if x.grad is None else x.grad + g.to(x.grad.dtype)

    def gram(self, gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """[N, N] inner products <grad_i, grad_j> of the training samples over the LoRA weights, from
        the kept per-sample rank-r gradients (all of them: call before `fold`), one layer at a time.
        `gather` maps this process's per-sample rows [n, d] to the whole batch's [N, d] (data parallel)."""
        if not self.keep_factors:
            raise RuntimeError("GhostHooks(keep_factors=True) is needed for the Gram matrix")
        if self.prompts:
            raise RuntimeError("the Gram matrix needs every row's own prompt: score without shared prompts")
        n = self.scores.numel()
        per_layer: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for i, rows, which, per in self.factors:
            per_layer.setdefault((i, which), []).append((rows, per))
        gram: torch.Tensor | None = None  # [N, N]: N is the whole batch's rows once gathered
        for key, layer in self.val_grads.items():  # every layer, also where this process has no rows
            for which, g in zip("AB", layer):
                grads = torch.zeros(n, g.numel(), dtype=g.dtype, device=g.device)
                for rows, per in per_layer.get((key, which), []):
                    grads[rows.to(grads.device)] = per.reshape(len(rows), -1).to(grads.dtype)
                if gather is not None:
                    grads = gather(grads)
                part = (grads @ grads.T).double().cpu()
                gram = part if gram is None else gram + part
        if gram is None:
            raise RuntimeError("the model has no LoRA layer to take gradients over")
        return gram


def influence_scores(
    model: torch.nn.Module, train_losses: Callable[[], torch.Tensor], val_loss: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """<grad of train_losses()[i], grad of val_loss()> over the model's LoRA A and B weights, for every i.

    train_losses() returns per-sample losses [N] from one batched forward; val_loss() a scalar.
    No per-sample gradient is materialised. Leaves the parameters' .grad as it found them (None).
    Returns [N] float64.
    """
    params = [p for layer in lora_layers(model) for p in (layer.a.weight, layer.b.weight)]
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        with GhostHooks(model) as hooks:
            val_loss().backward()
            hooks.capture_validation_gradient()
            losses = train_losses()  # [N]
            hooks.start_scoring(losses.shape[0], losses.device)
            losses.sum().backward()
        return hooks.scores
    finally:
        for p, g in zip(params, saved):
            p.grad = g
