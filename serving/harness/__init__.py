"""The research harness around the engine: workloads and traces
(``workloads``), replay (``replay``), the metrics report (``metrics``), the
iteration ledger (``ledger``), ablations (``ablation``), N simulated
replicas on one virtual clock (``cluster_sim``) and the tensor-parallel
check (``tp_check``)."""
