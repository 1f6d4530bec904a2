"""Tasks: the Task interface, boxed-answer math, multiple choice, and the registry of self-contained worlds."""
