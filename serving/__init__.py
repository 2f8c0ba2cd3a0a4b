"""iterserve's serving stack, one subpackage per concern.

* ``serving.engine``: the engine core. ``Engine`` (one iteration: fill
  slots, the ``plan`` program, host work, the ``step`` program, drain), its
  config, the model and simulated executors, packing, sampling and the
  virtual clock's cost model. Imports only ``serving.kv``.
* ``serving.kv``: the paged KV cache's page tables, swap to host memory and
  the prefix cache with the engine's bookkeeping of it.
* ``serving.http``: the OpenAI-compatible server, the data-parallel replica
  front and its router.
* ``serving.harness``: the research harness: workloads and traces, replay,
  the metrics report, the iteration ledger, ablations, the simulated cluster
  and the tensor-parallel check.
* ``serving.cli``: flag parsing and the launchers' shared setup.

``tests/test_layers.py`` enforces the import rule: the core imports neither
the HTTP front, the harness nor the CLI.
"""
