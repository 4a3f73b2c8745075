"""msa: MiniMax Sparse Attention for PyTorch training (docs/SPEC.md section 6)."""
from ._ops import has_cuda_kernel
from .interface import (fp8_index_copies, msa_attention, msa_attention_varlen, select_blocks, sparse_attention,
                        validate_cu_seqlens)
from . import distributed  # noqa: E402,F401  (msa.distributed: context parallelism)

try:  # the installed version, as the build recorded it (0.1.0+cu130 for a wheel variant)
    from ._build_info import version as __version__
except ImportError:  # a source tree setup.py never built: the base version
    from ._version import base_version as __version__
__all__ = ["msa_attention", "msa_attention_varlen", "select_blocks", "sparse_attention", "validate_cu_seqlens",
           "fp8_index_copies", "has_cuda_kernel"]
