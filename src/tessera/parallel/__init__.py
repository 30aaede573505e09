"""Training strategies applied to a model from outside, over a Mesh (data parallel and ZeRO
are one core, ``tessera.parallel.zero``, driven by ``tessera.boost``)."""
