"""Verifiers and rewards: the TRL-style reward functions and their contract (base.py).

A task (grpojax.data.tasks) holds its reward functions as objects; research
code passes its own in a registered Task. What runs them lives apart:
rewards/runtime/ (the host bridge from jitted code, the in-process runner, the
worker pool) and grpojax/sandbox/ (where the code reward runs programs).
"""

from __future__ import annotations

from grpojax.rewards.base import (RewardFn, RewardFunctionError, RewardOutput, TrainerState,
                                  completion_text, compute_rewards, reward_name, validate_weights)
from grpojax.rewards.code import CodeReward, ExecResult, code_reward, run_tests
from grpojax.rewards.countdown import CountdownReward, countdown_reward
from grpojax.rewards.format import OverlongPenalty, TagFormat, format_reward, soft_overlong_penalty
from grpojax.rewards.math import MathAccuracy, extract_answer, is_equivalent, math_accuracy_reward
from grpojax.rewards.runtime.host import HostRewards
