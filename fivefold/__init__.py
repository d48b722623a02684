"""fivefold: every parallelism dimension of LLM training, readable and tested against one
process."""

__version__ = "0.1.0"
