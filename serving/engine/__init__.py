"""The engine core: one iteration as a plan program and a step program
(docs/architecture.md walks it through these files).

* ``engine``: ``Engine``, the host side of one iteration, composing
  ``request_table`` (accepted requests, slots, queues, clients; the
  drain), ``clocks`` (host and device clocks), ``suspensions``
  (preemption records, swapped KV) and ``sim_driver`` (``simulate``'s host
  loop over ``sim_loop``'s program).
* ``programs``: the iteration body (``arrive``, ``plan_step``,
  ``execute_step``, ``release_slots``) and its jitted programs;
  ``facts``: the records they exchange with the host; ``requests``: the
  host's request records (``Request``, ``RequestOutput``, ``QueueFull``).
* ``config``: ``EngineConfig`` and ``SamplingParams``.
* ``executor``: the model step of a plan (pack, model, sample, take the
  tokens); ``sim_executor`` the simulated one on a virtual clock, timed by
  ``cost_model``.
* ``pack``, ``sampling``: packed rows of a plan; token sampling.
"""
