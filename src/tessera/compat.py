"""The versions of diffusers and transformers that Tessera's adapters were written for, in one place.

Tessera reaches inside both libraries: the diffusion adapters swap attention processors into
diffusers' PixArt, SD3 and Flux transformers and follow their block layouts; serving swaps an
attention function in through transformers' ``AttentionInterface`` and reads its configs;
training resolves transformers' ``base_model_tp_plan``. A release outside these ranges may
move any of that, so an adapter that meets one refuses by name (the package, the version
found and the range known to work) instead of computing something else quietly.
``pyproject.toml`` states the same ranges (``tests/test_versions.py`` checks that they agree).
Set ``TESSERA_ALLOW_UNTESTED_VERSIONS=1`` to run anyway, with a warning instead.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import warnings

# Known to work: the versions the adapters were written and tested against. Widen a range
# only after the test suite passes on the new version.
KNOWN_GOOD = {
    "diffusers": ">=0.42,<0.43",
    "transformers": ">=5.24,<5.25",
}
ALLOW_ENV = "TESSERA_ALLOW_UNTESTED_VERSIONS"


class VersionError(RuntimeError):
    """An adapter met a version of the library it mirrors that it was not written for."""


@functools.cache  # a lookup scans the installed distributions (~3 ms); they do not change while we run
def installed_version(package: str) -> str | None:
    """The installed distribution's version, or None when it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_versions(*packages: str) -> None:
    """Refuse (``VersionError``) an installed package outside its known-good range; every
    package in ``KNOWN_GOOD`` when none is named. A package that is not installed is left to
    its own import error."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    for package in packages or tuple(KNOWN_GOOD):
        if package not in KNOWN_GOOD:
            raise ValueError(f"no known-good range for {package!r}; known: {', '.join(KNOWN_GOOD)}")
        found = installed_version(package)
        if found is None:
            continue
        wanted = SpecifierSet(KNOWN_GOOD[package])
        if wanted.contains(Version(found), prereleases=True):
            continue
        message = (
            f"{package} {found} is not a version Tessera's adapters were written for: "
            f"install {package}{KNOWN_GOOD[package]} (or set {ALLOW_ENV}=1 to run anyway)"
        )
        if os.environ.get(ALLOW_ENV, "") not in ("", "0"):
            warnings.warn(message, stacklevel=2)
        else:
            raise VersionError(message)


__all__ = ["ALLOW_ENV", "KNOWN_GOOD", "VersionError", "check_versions", "installed_version"]
