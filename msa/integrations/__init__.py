"""Integrations of msa with model libraries. Each submodule imports its library only when imported itself:
`import msa.integrations.transformers` (the optional extra `msa-attention[hf]`)."""
