import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from sd3cluster.config import FlowConfig
from sd3cluster.flow import flow_loss, sample_key, sample_noise, shift_sigmas


def test_shift_matches_diffusers_scheduler():
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    u = torch.linspace(1.0, 0.001, 1000)  # the scheduler's unshifted sigmas
    torch.testing.assert_close(shift_sigmas(u, 3.0), sched.sigmas.float(), rtol=1e-4, atol=1e-5)


def test_noise_is_a_function_of_seed_and_sample_number():
    cfg = FlowConfig()
    n1, s1 = sample_noise(cfg, 0, 30, 6, (16, 4, 4))
    n2, s2 = sample_noise(cfg, 0, 30, 6, (16, 4, 4))
    n3, _ = sample_noise(cfg, 0, 36, 6, (16, 4, 4))
    assert torch.equal(n1, n2) and torch.equal(s1, s2) and not torch.equal(n1, n3)
    assert ((s1 > 0) & (s1 < 1)).all()


def test_a_rank_draws_its_slice_of_what_one_process_draws():
    """4 ranks x 3 samples of micro-step 7: each rank's own draw equals its slice of the whole global batch."""
    cfg, world, micro, step = FlowConfig(), 4, 3, 7
    whole, whole_sigmas = sample_noise(cfg, 5, step * world * micro, world * micro, (16, 4, 4))
    for rank in range(world):
        mine, my_sigmas = sample_noise(cfg, 5, step * world * micro + rank * micro, micro, (16, 4, 4))
        assert torch.equal(mine, whole[rank * micro:(rank + 1) * micro])
        assert torch.equal(my_sigmas, whole_sigmas[rank * micro:(rank + 1) * micro])


def test_sample_keys_of_neighbouring_seeds_do_not_overlap():
    """seed x constant + index would make seed 1's stream seed 0's, shifted; the mixed keys share nothing."""
    keys = {sample_key(seed, index) for seed in range(4) for index in range(5000)}
    assert len(keys) == 4 * 5000
    assert all(0 <= k < 2**64 for k in keys)


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
