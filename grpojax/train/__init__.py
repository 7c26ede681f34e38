"""Training: state, optimizer, the rollout and update programs."""

from grpojax import lazy

__getattr__, __dir__, __all__ = lazy.attach(__name__, {
    "optim": ["make_optimizer"],
    "rollout": ["Rollout", "RolloutConfig", "completion_logps"],
    "state": ["TrainState", "create_train_state", "sync_reference"],
    "step": ["update"],
})
