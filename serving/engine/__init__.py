"""The engine core: one iteration as a plan program and a step program
(docs/architecture.md walks it through these files).

* ``engine``: ``Engine``, the host loop of one iteration, and its records
  (``Request``, ``RequestOutput``, ``QueueFull``).
* ``config``: ``EngineConfig`` and ``SamplingParams``.
* ``executor``: the model step of a plan (pack, model, sample);
  ``sim_executor`` the simulated one on a virtual clock, timed by
  ``cost_model``.
* ``pack``, ``sampling``: packed rows of a plan; token sampling.
"""
