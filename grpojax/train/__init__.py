"""Training: state, optimizer, the rollout and update programs."""

from grpojax.train.optim import make_optimizer
from grpojax.train.rollout import Rollout, RolloutConfig, completion_logps
from grpojax.train.state import TrainState, create_train_state, sync_reference
from grpojax.train.step import update
