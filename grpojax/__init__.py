"""grpojax: GRPO (Group Relative Policy Optimization) for language models in JAX/Flax.

The names below load on first use: `import grpojax` itself imports no JAX."""

from grpojax import lazy

__version__ = "0.1.0"
__getattr__, __dir__, __all__ = lazy.attach(__name__, {
    "api": ["GRPOConfig", "GRPOTrainer"],
    "core": ["LossConfig", "group_advantages", "policy_loss", "register_advantage",
             "register_loss", "token_logprobs"],
})
