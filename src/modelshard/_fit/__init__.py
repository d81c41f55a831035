"""The fit area's façade: ``step_memory`` (a compiled step's memory per device, from XLA, split by
role) and ``fit_advice`` (the smallest change that fits a budget, each checked by compiling)."""

from .advice import KINDS as KINDS
from .advice import FitAdvice as FitAdvice
from .advice import Suggestion as Suggestion
from .advice import fit_advice as fit_advice
from .memory import PARTS as PARTS
from .memory import StepMemory as StepMemory
from .memory import compile_mesh as compile_mesh
from .memory import step_memory as step_memory
