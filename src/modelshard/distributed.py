"""One script, alone or on many processes: start JAX's distributed runtime from the environment.

``initialize()`` reads what ``modelshard launch`` or a cluster launcher put in the
environment; in a plain process it does nothing. ``barrier``, ``broadcast`` and ``gather``
go through the runtime's coordination service, not device collectives: no compiled program,
and at most ``MODELSHARD_BARRIER_TIMEOUT`` seconds of waiting before a ``DistributedError``
names the barrier.
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
