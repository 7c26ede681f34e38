"""Pure, jittable GRPO math: the research extension points."""

from grpojax import lazy

__getattr__, __dir__, __all__ = lazy.attach(__name__, {
    "advantages": ["combine_rewards", "group_advantages", "register_advantage"],
    "logprobs": ["chunked_token_logprobs", "entropy", "token_logprobs"],
    "losses": ["LossConfig", "policy_loss", "register_loss"],
})
