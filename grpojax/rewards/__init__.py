"""Verifiers and rewards: the TRL-style reward functions and their contract (base.py).

A task (grpojax.data.tasks) holds its reward functions as objects; research
code passes its own in a registered Task. What runs them lives apart:
rewards/runtime/ (the host bridge from jitted code, the in-process runner, the
worker pool) and grpojax/sandbox/ (where the code reward runs programs).
"""

from grpojax import lazy

__getattr__, __dir__, __all__ = lazy.attach(__name__, {
    "base": ["RewardFn", "RewardFunctionError", "RewardOutput", "TrainerState", "completion_text",
             "compute_rewards", "reward_name", "validate_weights"],
    "code": ["CodeReward", "ExecResult", "code_reward", "run_tests"],
    "countdown": ["CountdownReward", "countdown_reward"],
    "format": ["OverlongPenalty", "TagFormat", "format_reward", "soft_overlong_penalty"],
    "math": ["MathAccuracy", "extract_answer", "is_equivalent", "math_accuracy_reward"],
    "runtime.host": ["HostRewards"],
})
