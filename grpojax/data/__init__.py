"""Tasks and data: the task registry, generated tasks, and the prompt pipeline."""

from grpojax import lazy

__getattr__, __dir__, __all__ = lazy.attach(__name__, {
    "pipeline": ["PromptIterator", "prompt_text"],
    "tasks": ["TASKS", "Task", "get_task", "load_rows", "register_task"],
})
