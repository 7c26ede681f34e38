"""Tasks and data: the task registry, generated tasks, and the prompt pipeline."""

from grpojax import _lazy

__getattr__, __dir__, __all__ = _lazy.attach(__name__, {
    "pipeline": ["PromptIterator", "prompt_text"],
    "tasks": ["TASKS", "Task", "get_task", "load_rows", "register_task"],
})
