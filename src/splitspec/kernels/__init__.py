"""CPU kernels and the packed-residual reader that both actors use, owned by neither.

The CPU actor serves the residual product over its shard (``residual``, ``shard``); the engine computes
the same shards in-process for tests and its 2-bit base product with the same IR building blocks (``ir``).
Keeping them here lets ``gpu_actor`` and ``cpu_actor`` each import only this package and ``protocol``.
"""
