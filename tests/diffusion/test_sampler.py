import pytest
import torch

from tessera.diffusion.sampler import FlowMatchEuler, guided_velocity, initial_noise, sample
from tessera.models.dit import DiT, DiTConfig


class ConstantVelocity(torch.nn.Module):
    """v(x, t, y) = y-dependent constant; Euler integrates it exactly."""

    null_class = 2

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x, t, y):
        return torch.ones_like(x) * (y.float() + 1)[:, None, None, None]


def test_euler_integrates_constant_field_exactly():
    model = ConstantVelocity()
    labels = torch.tensor([0, 1])
    x = sample(model, labels, image_shape=(1, 2, 2), num_steps=7, seed=3, progress=False)
    noise = initial_noise((2, 1, 2, 2), 3)
    # x_0 = x_1 - integral of v over [0, 1] = noise - (y + 1); 7 float32 steps of 1/7.
    torch.testing.assert_close(x, noise - torch.tensor([1.0, 2.0])[:, None, None, None], rtol=0, atol=1e-6)


def test_guidance_combines_branches():
    model = ConstantVelocity()
    x, t, y = torch.zeros(2, 1, 2, 2), torch.ones(2), torch.tensor([0, 1])
    v = guided_velocity(model, x, t, y, null_label=2, guidance_scale=3.0)
    # uncond = 3, cond = y + 1  ->  3 + 3 * (y + 1 - 3)
    expected = torch.tensor([3 + 3 * (1 - 3), 3 + 3 * (2 - 3)], dtype=torch.float32)
    assert torch.equal(v[:, 0, 0, 0], expected)
    assert torch.equal(guided_velocity(model, x, t, y, 2, 1.0), model(x, t, y))


def test_same_seed_same_images_different_seed_different_images():
    torch.manual_seed(0)
    model = DiT(DiTConfig(image_size=4, patch_size=2, hidden_size=16, depth=1, num_heads=2)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    labels = torch.tensor([1, 2, 3])
    kw = dict(image_shape=(1, 4, 4), num_steps=4, guidance_scale=2.0, progress=False)
    a, b = sample(model, labels, seed=5, **kw), sample(model, labels, seed=5, **kw)
    assert torch.equal(a, b)
    # allclose's defaults (rtol 1e-5, atol 1e-8): other noise gives O(1) different images
    assert not torch.allclose(a, sample(model, labels, seed=6, **kw))


def test_zero_steps_is_an_error():
    with pytest.raises(ValueError, match="got 0"):
        FlowMatchEuler().timesteps(0)
