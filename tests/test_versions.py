"""The diffusers and transformers releases the adapters were written for: the installed ones
are inside the ranges (so an upgrade fails here, by name, before it fails anywhere subtler),
pyproject.toml says the same ranges as tessera.compat, and an adapter that meets a version
outside its range refuses it by name."""

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tessera import compat

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@pytest.mark.parametrize("package", sorted(compat.KNOWN_GOOD))
def test_installed_version_is_known_good(package):
    assert compat.installed_version(package) is not None, f"{package} is not installed"
    compat.check_versions(package)  # a VersionError here names the package, its version and the range


def test_pyproject_pins_the_same_ranges():
    deps = [Requirement(d) for d in tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]]
    pinned = {d.name: d.specifier for d in deps}
    for package, wanted in compat.KNOWN_GOOD.items():
        assert pinned.get(package) == SpecifierSet(wanted), (package, str(pinned.get(package)), wanted)


@pytest.fixture
def fake_versions(monkeypatch):
    """Make the version lookup answer what the test says (others as installed)."""
    monkeypatch.delenv(compat.ALLOW_ENV, raising=False)
    fakes: dict[str, str] = {}
    real = compat.installed_version
    monkeypatch.setattr(compat, "installed_version", lambda p: fakes.get(p) or real(p))
    return fakes


@pytest.mark.parametrize("package,version", [("transformers", "5.30.0"), ("diffusers", "0.41.9")])
def test_out_of_range_version_is_refused_by_name(fake_versions, package, version):
    fake_versions[package] = version
    with pytest.raises(compat.VersionError) as info:
        compat.check_versions(package)
    message = str(info.value)
    assert f"{package} {version}" in message and compat.KNOWN_GOOD[package] in message, message
    assert "\n" not in message


def test_allow_env_turns_the_refusal_into_a_warning(fake_versions, monkeypatch):
    fake_versions["transformers"] = "6.0.0"
    monkeypatch.setenv(compat.ALLOW_ENV, "1")
    with pytest.warns(UserWarning, match=r"transformers 6\.0\.0"):
        compat.check_versions("transformers")


def test_unknown_package_is_a_value_error():
    with pytest.raises(ValueError, match="no known-good range for 'numpy'"):
        compat.check_versions("numpy")


def test_diffusers_adapter_refuses_an_unknown_release(fake_versions):
    import diffusers

    from tessera.diffusion.adapters import adapter_for

    fake_versions["diffusers"] = "0.50.0"
    # isinstance is all adapter_for looks at before the check: no weights need building
    model = object.__new__(diffusers.PixArtTransformer2DModel)
    with pytest.raises(compat.VersionError, match=r"diffusers 0\.50\.0 .*diffusers>=0\.42,<0\.43"):
        adapter_for(model)


def test_served_model_loader_refuses_an_unknown_transformers(fake_versions, tmp_path):
    from tessera.serve.model import load_model

    fake_versions["transformers"] = "4.57.1"
    with pytest.raises(compat.VersionError, match=r"transformers 4\.57\.1 .*transformers>=5\.24,<5\.25"):
        load_model(tmp_path)  # refused before the folder is read


def test_boost_refuses_an_unknown_transformers_for_plans_that_read_it(fake_versions):
    """tp/pp/sp/ep read transformers' plans, mask functions and attention interface: boost
    refuses an untested release by name before it changes anything."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tessera import Plan, boost

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fake_versions["transformers"] = "5.30.0"
    with pytest.raises(compat.VersionError, match=r"transformers 5\.30\.0 .*transformers>=5\.24,<5\.25"):
        boost(model, torch.optim.SGD(model.parameters(), lr=0.1), Plan(pp=2))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_constraints_file_pins_the_same_ranges():
    """constraints.txt (what make install and CI resolve against) says the same ranges."""
    lines = (PYPROJECT.parent / "constraints.txt").read_text().splitlines()
    reqs = {
        r.name: r.specifier
        for r in (Requirement(line) for line in lines if line.strip() and not line.startswith("#"))
    }
    for package, wanted in compat.KNOWN_GOOD.items():
        assert reqs.get(package) == SpecifierSet(wanted), (package, str(reqs.get(package)), wanted)
