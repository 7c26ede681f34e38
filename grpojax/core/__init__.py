"""Pure, jittable GRPO math: the research extension points."""

from grpojax.core import advantages, logprobs, losses
from grpojax.core.advantages import combine_rewards, group_advantages, register_advantage
from grpojax.core.logprobs import chunked_token_logprobs, entropy, token_logprobs
from grpojax.core.losses import LossConfig, policy_loss, register_loss
