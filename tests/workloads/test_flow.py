import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from sd3cluster.config import FlowConfig
from sd3cluster.flow import batch_noise, flow_loss, shift_sigmas


def test_shift_matches_diffusers_scheduler():
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    u = torch.linspace(1.0, 0.001, 1000)  # the scheduler's unshifted sigmas
    torch.testing.assert_close(shift_sigmas(u, 3.0), sched.sigmas.float(), rtol=1e-4, atol=1e-5)


def test_noise_is_a_function_of_seed_and_step():
    cfg = FlowConfig()
    n1, s1 = batch_noise(cfg, 0, 5, 6, (16, 4, 4))
    n2, s2 = batch_noise(cfg, 0, 5, 6, (16, 4, 4))
    n3, _ = batch_noise(cfg, 0, 6, 6, (16, 4, 4))
    assert torch.equal(n1, n2) and torch.equal(s1, s2) and not torch.equal(n1, n3)
    assert ((s1 > 0) & (s1 < 1)).all()


class _Oracle(torch.nn.Module):
    """Predicts the exact velocity noise - x0 (it is handed both): the loss must be zero."""

    def __init__(self, x0, noise):
        super().__init__()
        self.x0, self.noise = x0, noise

    def forward(self, hidden_states, **_):
        return (self.noise - self.x0,)


def test_rectified_flow_target():
    x0, noise = torch.randn(3, 16, 4, 4), torch.randn(3, 16, 4, 4)
    sigmas = torch.tensor([0.1, 0.5, 0.9])
    for precondition in (True, False):
        cfg = FlowConfig(precondition_outputs=precondition)
        loss = flow_loss(_Oracle(x0, noise), cfg, x0, None, None, noise, sigmas)
        assert float(loss) < 1e-10
