"""grpojax: GRPO (Group Relative Policy Optimization) for language models in JAX/Flax."""

__version__ = "0.1.0"
