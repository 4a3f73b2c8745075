"""msa: MiniMax Sparse Attention for PyTorch training (SPEC.md section 6)."""
from ._ops import has_cuda_kernel
from .interface import msa_attention, msa_attention_varlen, select_blocks, sparse_attention, validate_cu_seqlens

__version__ = "0.1.0"
__all__ = ["msa_attention", "msa_attention_varlen", "select_blocks", "sparse_attention", "validate_cu_seqlens",
           "has_cuda_kernel"]
