"""Discrete-event simulation of a specray deployment: the real coordinator, simulated workers.

``simulate(load_sim_config("specray/sim/configs/h100_tp4_l4.yaml"))`` answers sizing questions
(draft workers per target group, k, throughput and latency by concurrency and network RTT) for
clusters this machine does not have; ``python -m specray.sim --config FILE`` prints the table.
"""

from specray.sim.clock import SimulationDeadlock, VirtualTimeLoop, run_virtual
from specray.sim.model import (
    AcceptanceModel,
    LatencyModel,
    SimConfig,
    SimConfigError,
    Workload,
    acceptance_from_metrics,
    load_sim_config,
    sim_config_from_dict,
)
from specray.sim.run import format_table, simulate

__all__ = [
    "AcceptanceModel",
    "LatencyModel",
    "SimConfig",
    "SimConfigError",
    "SimulationDeadlock",
    "VirtualTimeLoop",
    "Workload",
    "acceptance_from_metrics",
    "format_table",
    "load_sim_config",
    "run_virtual",
    "sim_config_from_dict",
    "simulate",
]
