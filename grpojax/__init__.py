"""grpojax: GRPO (Group Relative Policy Optimization) for language models in JAX/Flax."""

from grpojax import config, core, models, sampling
from grpojax.api import GRPOConfig, GRPOTrainer
from grpojax.core import (
    LossConfig,
    group_advantages,
    policy_loss,
    register_advantage,
    register_loss,
    token_logprobs,
)

__version__ = "0.1.0"
