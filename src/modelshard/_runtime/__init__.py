"""The runtime area's façade: ``modelshard launch`` and ``modelshard.distributed``'s runtime."""

from .distributed import DEFAULT_BARRIER_TIMEOUT_S as DEFAULT_BARRIER_TIMEOUT_S
from .distributed import ENV_BARRIER_TIMEOUT as ENV_BARRIER_TIMEOUT
from .distributed import ENV_HEARTBEAT_TIMEOUT as ENV_HEARTBEAT_TIMEOUT
from .distributed import ENV_LOCAL_DEVICES as ENV_LOCAL_DEVICES
from .distributed import ENV_NUM_PROCESSES as ENV_NUM_PROCESSES
from .distributed import ENV_PROCESS_ID as ENV_PROCESS_ID
from .distributed import barrier as barrier
from .distributed import barrier_timeout_s as barrier_timeout_s
from .distributed import broadcast as broadcast
from .distributed import cluster_detected as cluster_detected
from .distributed import gather as gather
from .distributed import initialize as initialize
from .distributed import is_main_process as is_main_process
from .distributed import local_slice as local_slice
from .distributed import require_addressable as require_addressable
from .distributed import to_host as to_host
from .failures import Outcome as Outcome
from .failures import outcome as outcome
from .failures import raise_shared as raise_shared
from .failures import shared_error as shared_error
from .processes import ENV_COORDINATOR as ENV_COORDINATOR
from .processes import main as main
