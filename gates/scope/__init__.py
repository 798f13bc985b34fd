"""The scope policy of agent tasks: which repository paths a task's pull request may change (policy.py).

Not here: the task template schema that names a task's globs (gates.tasks.schema) and the rules that read a
branch and report violations (gates.tasks.check).
"""
