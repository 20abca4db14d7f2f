"""packattn: exact attention over packed variable-length batches, on every PyTorch device."""

from .api import varlen_attention
from .dispatch import BackendInfo, info
from .errors import InputTypeError
from .merge import merge_attention_states

__all__ = ["BackendInfo", "InputTypeError", "info", "merge_attention_states", "varlen_attention"]
__version__ = "0.1.0"
