"""CPU kernels and the packed-residual reader that both actors use, owned by neither.

The CPU actor serves the residual product over its shard (``residual``, ``shard``); the engine computes
the same shards in-process for tests. The CPU's 2-bit base product (``cpu_base``) is the engine's, and the
CPU actors' too for their share of a prompt's base (``EngineConfig.base_share``).
Keeping them here lets ``gpu_actor`` and ``cpu_actor`` each import only this package and ``protocol``.
"""
