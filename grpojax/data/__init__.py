"""Tasks and data: the task registry, generated tasks, and the prompt pipeline."""

from grpojax.data.pipeline import PromptIterator, prompt_text
from grpojax.data.tasks import TASKS, Task, get_task, load_rows, register_task
