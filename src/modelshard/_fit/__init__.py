"""The fit area's façade: ``step_memory`` and ``fit_advice``, each from compiling."""

from .advice import KINDS as KINDS
from .advice import FitAdvice as FitAdvice
from .advice import Suggestion as Suggestion
from .advice import fit_advice as fit_advice
from .memory import PARTS as PARTS
from .memory import StepMemory as StepMemory
from .memory import step_memory as step_memory
