"""The research harness around the engine: workloads (``workloads``) read
from traces (``traces``) or synthesised (``synthetic``), replay
(``replay``), the metrics report (``metrics``), the iteration ledger
(``ledger``), ablations (``ablation``), N simulated replicas on one virtual
clock (``cluster_sim``), the tensor-parallel check (``tp_check``) and a closed
loop of c live requests with the prompt-copying workload (``closed_loop``)."""
