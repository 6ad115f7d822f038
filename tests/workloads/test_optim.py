"""Gradient clipping folded into fused AdamW (its grad_scale divisor) against clip_grad_norm_ and a step."""

import pytest
import torch
from sd3cluster.optim import clip_divisor, fused_adamw

SHAPES = ((64, 32), (32,), (7, 5, 3))


def _run(mode: str, scale: float, steps: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Parameters and first moments after `steps` fused AdamW steps on seeded gradients of size ~scale, clipped
    to norm 1 by clip_grad_norm_ ("clip"), through grad_scale ("fold"), or not at all ("none")."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=gen).requires_grad_() for shape in SHAPES]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * scale
        if mode == "clip":
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        elif mode == "fold":
            opt.grad_scale = clip_divisor(torch.nn.utils.get_total_norm([p.grad for p in params]), 1.0)
        opt.step()
    return [p.detach() for p in params], [opt.state[p]["exp_avg"] for p in params]


@pytest.mark.parametrize("scale", [10.0, 0.01], ids=["norm above the limit", "norm below the limit"])
def test_clip_in_fused_adamw_equals_clip_grad_norm_then_step(scale):
    clipped, folded, unclipped = _run("clip", scale), _run("fold", scale), _run("none", scale)
    for got, expected in zip(folded[0] + folded[1], clipped[0] + clipped[1], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    # the moments saw clipped gradients where the norm was over the limit, the gradients as they were under it
    differs = any(not torch.allclose(a, b, rtol=1e-3) for a, b in zip(folded[1], unclipped[1], strict=True))
    assert differs == (scale > 1)


def test_fused_adamw_names_the_optimizers_that_take_the_fold():
    params = [torch.zeros(3, requires_grad=True)]
    assert fused_adamw(torch.optim.AdamW(params, fused=True))
    assert not fused_adamw(torch.optim.AdamW(params, foreach=True))
    assert not fused_adamw(torch.optim.Adam(params, fused=True))


def test_clip_divisor_is_one_under_the_limit_and_the_ratio_above():
    assert clip_divisor(torch.tensor(0.5), 1.0).item() == 1.0
    assert clip_divisor(torch.tensor(4.0), 2.0).item() == pytest.approx(2.0, rel=1e-6)


def test_trainer_step_clips_inside_fused_adamw_as_clip_grad_norm_does(tmp_path):
    """The Trainer's two clip paths on the same tiny run: equal norms, parameters and moments after a step (CPU
    trainers take the non-fused AdamW, so both get a fused one here; a tiny limit makes the clip bite)."""
    from sd3cluster.config import Config
    from sd3cluster.dist import local_runtime
    from sd3cluster.optim import make_warmup
    from sd3cluster.train import Trainer

    cfg = Config.model_validate({"model": {"preset": "tiny"}, "optim": {"grad_clip": 1e-3},
                                 "data": {"synthetic_samples": 4, "resolution": 64, "batch_size": 2},
                                 "output": {"dir": str(tmp_path)}})
    runs = {}
    for fold in (False, True):
        trainer = Trainer(cfg, local_runtime(torch.device("cpu")))
        trainer.optimizer = torch.optim.AdamW(trainer.params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                              fused=True)
        trainer.scheduler = make_warmup(trainer.optimizer, cfg.optim.warmup_steps)
        trainer.clip_in_optimizer = fold
        metrics = trainer.train_step()
        runs[fold] = (metrics, [p.detach().clone() for p in trainer.params],
                      [trainer.optimizer.state[p]["exp_avg"].clone() for p in trainer.params])
        trainer.close()
    (m_clip, p_clip, avg_clip), (m_fold, p_fold, avg_fold) = runs[False], runs[True]
    assert m_fold["grad_norm"] == pytest.approx(m_clip["grad_norm"], rel=1e-6) and m_clip["grad_norm"] > 1e-2
    for got, expected in zip(p_fold + avg_fold, p_clip + avg_clip, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-9)
    # the moments hold clipped gradients: (1 - beta1) x gradient x (limit / norm), their norm about 0.1 x 1e-3
    moment_norm = torch.nn.utils.get_total_norm(avg_fold).item()
    assert moment_norm == pytest.approx((1 - cfg.optim.betas[0]) * 1e-3, rel=1e-3)
