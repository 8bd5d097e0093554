"""The control plane: the supervisor (failure detection, the stop rules, handing lost ranks to
spares, the run's report and metrics), the node agents and the processes they start (a fork
server among them). It imports protocol/ and never the training process's code (worker/): what it
knows of a worker is what the worker writes to the store.
"""
from .agent import NodeAgent, run_agent
from .processes import start_process, stop_all
from .supervisor import JobFailed, Supervisor, SupervisorConfig

__all__ = ["Supervisor", "SupervisorConfig", "JobFailed", "NodeAgent", "run_agent", "start_process",
           "stop_all"]
