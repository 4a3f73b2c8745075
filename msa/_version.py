"""The version of msa (distribution `msa-attention`): the one place it is written.

setup.py reads `base_version` from this file (without importing the package) and appends the local
label of a wheel variant from MSA_LOCAL_VERSION (`0.1.0+cu130`). `msa.__version__` is the installed
version: the one the build recorded in msa/_build_info.py, else this base version (a source tree that
was never built).
"""
base_version = "0.1.0"
