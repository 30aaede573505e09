"""Training strategies applied to a model from outside, over a Mesh."""

from tessera.parallel.data_parallel import data_parallel

__all__ = ["data_parallel"]
