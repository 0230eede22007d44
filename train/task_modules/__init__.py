"""Tasks beyond train/tasks.py's built-in ones: each module here defines one ``TASK`` (a
train.tasks.Task), and train/tasks.py registers every module of this package (in name order)
into its TASKS. Reach a task through ``train.tasks.get(name)``."""

# A module here imported first (import train.task_modules.<name>) still finds train.tasks
# whole: the registry loads, and registers the module, before the module's own import runs.
import train.tasks  # noqa: F401
