"""Tasks beyond train/tasks.py's built-in ones: each module here defines one ``TASK`` (a
train.tasks.Task), and train/tasks.py registers every module of this package (in name order)
into its TASKS. A module here imports train.tasks for Task and its helpers; only train/tasks.py
imports the modules, so import the task through ``train.tasks.get(name)``."""
