"""One script, alone or on many processes: start JAX's distributed runtime from the environment.

``initialize()`` reads what ``modelshard launch`` (or a cluster launcher: SLURM, Open MPI,
a Cloud TPU pod, anything that sets ``JAX_COORDINATOR_ADDRESS``) put in the environment and
calls ``jax.distributed.initialize``; in a plain single process it does nothing. Call it
first, before any JAX computation, and the same script runs unchanged everywhere.

The helpers below are the few multi-process operations a training script needs:
``is_main_process`` (who prints and logs), ``barrier`` (everyone waits), ``broadcast``
(process 0's decision on every process), ``gather`` (one small value from each process)
and ``to_host`` (a global array's full value on every process, through an all-gather).

``barrier``, ``broadcast`` and ``gather`` go through the distributed runtime's coordination
service (its barriers and key-value store), not through device collectives: they need no
compiled program, can never be confused with the user's own collectives, and wait at most
``MODELSHARD_BARRIER_TIMEOUT`` seconds (``DEFAULT_BARRIER_TIMEOUT_S``) before raising a
``DistributedError`` that names the barrier. A process that dies is noticed by the runtime
after ``MODELSHARD_HEARTBEAT_TIMEOUT`` seconds (JAX's ``heartbeat_timeout_seconds``, 100 by
default), and then every other process is terminated with an error saying so.
"""

from ._runtime import DEFAULT_BARRIER_TIMEOUT_S as DEFAULT_BARRIER_TIMEOUT_S
from ._runtime import ENV_BARRIER_TIMEOUT as ENV_BARRIER_TIMEOUT
from ._runtime import ENV_COORDINATOR as ENV_COORDINATOR
from ._runtime import ENV_HEARTBEAT_TIMEOUT as ENV_HEARTBEAT_TIMEOUT
from ._runtime import ENV_LOCAL_DEVICES as ENV_LOCAL_DEVICES
from ._runtime import ENV_NUM_PROCESSES as ENV_NUM_PROCESSES
from ._runtime import ENV_PROCESS_ID as ENV_PROCESS_ID
from ._runtime import barrier as barrier
from ._runtime import barrier_timeout_s as barrier_timeout_s
from ._runtime import broadcast as broadcast
from ._runtime import cluster_detected as cluster_detected
from ._runtime import gather as gather
from ._runtime import initialize as initialize
from ._runtime import is_main_process as is_main_process
from ._runtime import local_slice as local_slice
from ._runtime import require_addressable as require_addressable
from ._runtime import to_host as to_host

__all__ = [
    "DEFAULT_BARRIER_TIMEOUT_S",
    "ENV_BARRIER_TIMEOUT",
    "ENV_COORDINATOR",
    "ENV_HEARTBEAT_TIMEOUT",
    "ENV_LOCAL_DEVICES",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "barrier",
    "barrier_timeout_s",
    "broadcast",
    "cluster_detected",
    "gather",
    "initialize",
    "is_main_process",
    "local_slice",
    "require_addressable",
    "to_host",
]
