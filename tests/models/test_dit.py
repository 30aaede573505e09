import pytest
import torch

from tessera.models.dit import DiT, DiTConfig

TINY = DiTConfig(
    image_size=8, in_channels=2, patch_size=2, hidden_size=32, depth=2, num_heads=4, num_classes=3
)


def _randomised(config: DiTConfig = TINY) -> DiT:
    torch.manual_seed(0)
    model = DiT(config)
    with torch.no_grad():  # leave adaLN-zero's identity start so every path is exercised
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def test_output_shape_and_non_square_sizes():
    model = _randomised()
    for h, w in [(8, 8), (6, 10), (12, 4)]:
        x = torch.randn(3, 2, h, w)
        out = model(x, torch.rand(3), torch.tensor([0, 1, 3]))
        assert out.shape == x.shape


def test_patchify_unpatchify_round_trip():
    model = _randomised()
    x = torch.randn(2, 2, 6, 10)
    assert torch.equal(model.unpatchify(model.patchify(x), grid_cols=5), x)


def test_band_embedding_equals_slice_of_full_embedding():
    """A horizontal band embedded with its row offset gets the same tokens as in the full
    image: what patch-parallel methods rely on."""
    model = _randomised()
    x = torch.randn(1, 2, 8, 8)
    full = model.embed(x)
    band = model.embed(x[:, :, 4:6], row_offset=2)  # patch rows 2 of a 4x4 grid
    torch.testing.assert_close(band, full[:, 8:12], rtol=0, atol=0)  # the same ops on the same numbers


def test_adaln_zero_starts_as_zero_velocity():
    torch.manual_seed(0)
    model = DiT(TINY)
    out = model(torch.randn(2, 2, 8, 8), torch.rand(2), torch.tensor([0, 3]))
    assert torch.count_nonzero(out) == 0


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("image_size", 9, "image_size 9 is not divisible by patch_size 2"),
        ("num_heads", 5, "hidden_size 32 is not divisible by num_heads 5"),
        ("depth", 0, "depth must be a positive integer"),
    ],
)
def test_config_validation(field, value, message):
    with pytest.raises(ValueError, match=message):
        DiTConfig(**{**TINY.to_dict(), field: value})


def test_bad_input_shape_is_named():
    model = _randomised()
    with pytest.raises(ValueError, match="image size 7x8 is not divisible by the patch size 2"):
        model(torch.randn(1, 2, 7, 8), torch.rand(1), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"\(B, 2, H, W\)"):
        model(torch.randn(1, 3, 8, 8), torch.rand(1), torch.tensor([0]))


def test_config_dict_round_trip_rejects_unknown_fields():
    assert DiTConfig.from_dict(TINY.to_dict()) == TINY
    with pytest.raises(ValueError, match="unknown DiTConfig fields"):
        DiTConfig.from_dict({**TINY.to_dict(), "layers": 3})
