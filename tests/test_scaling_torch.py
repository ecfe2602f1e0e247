"""LRScaler on a real torch optimizer: the user's LR scheduler keeps its own schedule."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cannikin.scaling import LRScaler  # noqa: E402


def make_sgd(lr: float = 0.5) -> tuple[torch.nn.Parameter, torch.optim.SGD]:
    param = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    return param, torch.optim.SGD([param], lr=lr)


@pytest.mark.parametrize("make_scheduler", [
    lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch)),
])
def test_factor_multiplies_the_scheduled_lr(make_scheduler) -> None:
    ref_param, ref_opt = make_sgd()
    ref_sched = make_scheduler(ref_opt)
    param, opt = make_sgd()
    sched = make_scheduler(opt)
    scaler = LRScaler(opt, "linear", init_batch=8)
    grad = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    for step in range(7):
        total_batch = 8 * (1 + step % 3)
        scheduled_lr = ref_sched.get_last_lr()[0]
        before = param.detach().clone()
        param.grad = grad.clone()
        factor = scaler.step_begin(total_batch, None, None)
        opt.step()
        scaler.step_end()
        sched.step()
        ref_opt.step()  # no parameters have grads: only the schedule advances
        ref_sched.step()
        assert factor == total_batch / 8
        assert torch.allclose(before - param.detach(), scheduled_lr * factor * grad)
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        assert sched.get_last_lr() == ref_sched.get_last_lr()


def test_works_from_optimizer_step_hooks() -> None:
    """The runtime applies the scaler from torch's public optimizer step hooks."""
    param, opt = make_sgd(lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    scaler = LRScaler(opt, "adascale", init_batch=16)
    seen: list[float] = []
    opt.register_step_pre_hook(lambda *_: seen.append(scaler.step_begin(64, 1.0, 160.0)))
    opt.register_step_post_hook(lambda *_: scaler.step_end())
    for _ in range(3):
        param.grad = torch.ones(3, dtype=torch.float64)
        lr = opt.param_groups[0]["lr"]
        before = param.detach().clone()
        opt.step()
        sched.step()
        assert torch.allclose(before - param.detach(), torch.full((3,), lr * seen[-1],
                                                                  dtype=torch.float64))
    assert seen[-1] == pytest.approx((10 + 1) / (2.5 + 1))
    assert scaler.steps == 3 and scaler.progress == pytest.approx(3 * seen[-1])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.9**3)


def test_a_schedule_indexed_by_progress() -> None:
    # the docs' pattern (docs/runtime.md, "The learning rate as B grows"): a LambdaLR that
    # reads the scaler's progress steps the schedule in B0-steps of statistical progress
    param, opt = make_sgd(lr=1.0)
    scaler = LRScaler(opt, "adascale", init_batch=8)

    def schedule(progress: float) -> float:
        return 0.1 if progress >= 10 else 1.0

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: schedule(scaler.progress))
    grad = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    steps_at_full_rate = 0
    for _ in range(12):
        progress = scaler.progress
        before = param.detach().clone()
        param.grad = grad.clone()
        factor = scaler.step_begin(64, grad_sqr=1.0, grad_var=64.0)  # gain (8+1)/(1+1) = 4.5
        opt.step()
        scaler.step_end()
        sched.step()
        assert factor == pytest.approx(4.5)
        assert torch.allclose(before - param.detach(), schedule(progress) * factor * grad)
        steps_at_full_rate += progress < 10
    assert scaler.progress == pytest.approx(12 * 4.5)
    assert steps_at_full_rate == 3  # progress 0, 4.5, 9: 3 steps of 64 samples, not 10
