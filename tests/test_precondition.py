"""Preconditioner: identity for SGD, Adam/AdamW second moment checked by hand."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from cannikin.runtime.precondition import Preconditioner  # noqa: E402


def run_steps(opt: torch.optim.Optimizer, param: torch.nn.Parameter, grads) -> None:
    for g in grads:
        param.grad = g.clone()
        opt.step()


def grads_sequence(steps: int, size: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(size, generator=gen, dtype=torch.float64) for _ in range(steps)]


def reference_denominator(grads, beta2: float, eps: float, amsgrad: bool) -> torch.Tensor:
    """sqrt(v_hat) + eps from Adam's recurrence, recomputed independently."""
    v = torch.zeros_like(grads[0])
    v_max = torch.zeros_like(grads[0])
    for g in grads:
        v = beta2 * v + (1 - beta2) * g * g
        v_max = torch.maximum(v_max, v)
    second = v_max if amsgrad else v
    return (second / (1 - beta2 ** len(grads))).sqrt() + eps


def test_identity_for_sgd() -> None:
    param = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    opt = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    run_steps(opt, param, grads_sequence(8))
    pre = Preconditioner(opt)
    grad = torch.ones(5, dtype=torch.float64)
    assert not pre.adaptive and not pre.active and pre(param, grad) is grad


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_second_moment(opt_cls, amsgrad: bool) -> None:
    param = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    opt = opt_cls([param], lr=1e-3, betas=(0.8, 0.95), eps=1e-3, amsgrad=amsgrad)
    pre = Preconditioner(opt, warmup_steps=3)
    grads = grads_sequence(6)
    grad = torch.full((5,), 0.7, dtype=torch.float64)
    assert pre(param, grad) is grad and not pre.active  # no state yet
    run_steps(opt, param, grads[:2])
    assert pre(param, grad) is grad and not pre.active  # still warming up
    run_steps(opt, param, grads[2:])
    assert pre.active
    expected = grad / reference_denominator(grads, 0.95, 1e-3, amsgrad)
    assert torch.allclose(pre(param, grad), expected, rtol=1e-12)


def test_groups_added_later_and_unknown_params() -> None:
    first = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    opt = torch.optim.Adam([first], lr=1e-3, eps=1e-8)
    pre = Preconditioner(opt, warmup_steps=1)
    later = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    opt.add_param_group({"params": [later], "eps": 0.5, "betas": (0.9, 0.5)})
    grads = grads_sequence(2)
    for g in grads:
        first.grad, later.grad = g.clone(), g.clone()
        opt.step()
    grad = torch.ones(5, dtype=torch.float64)
    expected = grad / reference_denominator(grads, 0.5, 0.5, amsgrad=False)
    assert torch.allclose(pre(later, grad), expected)
    stranger = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    assert pre(stranger, grad) is grad
    with pytest.raises(ValueError, match="warmup_steps"):
        Preconditioner(opt, warmup_steps=0)


def test_adam_noise_scale_is_measured_in_the_preconditioned_space() -> None:
    """Rescaling one coordinate's gradient does not change Adam's preconditioned norm."""
    param = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = torch.optim.Adam([param], lr=1e-3, eps=1e-12)
    scaled = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt_scaled = torch.optim.Adam([scaled], lr=1e-3, eps=1e-12)
    grads = grads_sequence(10, size=2)
    factor = torch.tensor([1.0, 1000.0], dtype=torch.float64)
    run_steps(opt, param, grads)
    run_steps(opt_scaled, scaled, [g * factor for g in grads])
    grad = torch.tensor([0.3, -0.4], dtype=torch.float64)
    a = Preconditioner(opt)(param, grad)
    b = Preconditioner(opt_scaled)(scaled, grad * factor)
    assert torch.allclose(a, b, rtol=1e-9)
    assert not math.isclose(float(grad.norm()), float((grad * factor).norm()))
