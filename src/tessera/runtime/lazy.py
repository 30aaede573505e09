"""Public names a package loads on first use (PEP 562), so that importing the package (and
the command line's ``--help``) does not pay for torch, transformers or diffusers until a
name is used. Light on purpose: it imports nothing but the standard library."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_names(package: str, where: dict[str, str], public: list[str]) -> tuple[Callable, Callable]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package``: a name of ``where``
    (name -> the module defining it) is imported on first use and kept."""
    module = sys.modules[package]

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(module, name, value)  # loaded once
        return value

    def __dir__() -> list[str]:
        return sorted(set(public) | set(vars(module)))

    return __getattr__, __dir__
