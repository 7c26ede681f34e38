"""Verifiers and rewards: TRL-style reward functions, a sandbox, the host bridge.

Ready-made reward functions are registered by name, so tasks and configs
pick them as strings; research code adds its own with `register_reward`.
"""

from __future__ import annotations

from collections.abc import Callable

from grpojax.rewards.base import (RewardFn, RewardFunctionError, RewardOutput, completion_text,
                                  compute_rewards, reward_name, validate_weights)
from grpojax.rewards.code import CodeReward, ExecResult, code_reward, run_tests
from grpojax.rewards.countdown import CountdownReward, countdown_reward
from grpojax.rewards.format import OverlongPenalty, TagFormat, format_reward, soft_overlong_penalty
from grpojax.rewards.host import HostRewards, decode_chars
from grpojax.rewards.math import MathAccuracy, extract_answer, is_equivalent, math_accuracy_reward

REWARDS: dict[str, RewardFn] = {
    "math_accuracy": math_accuracy_reward,
    "countdown": countdown_reward,
    "code": code_reward,
    "format": format_reward,
}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make a reward function available under `name`."""
    def register(fn: RewardFn) -> RewardFn:
        if name in REWARDS and REWARDS[name] is not fn:
            raise ValueError(f"a reward named {name!r} is already registered")
        REWARDS[name] = fn
        return fn
    return register


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise ValueError(f"reward {name!r} is unknown; known: {', '.join(sorted(REWARDS))}")
    return REWARDS[name]
