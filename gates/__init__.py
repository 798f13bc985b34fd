"""The gating area of k3forge, one room per concern: core (the judging machinery), checks (the gates), evals
(model-level evals), problems (each op's inputs and checks), evidence (bundles and reports), scope (which paths
a task may change), tasks (the agent-task workflow) and commands (the CLI's gating commands; cli.py assembles
`k3forge`). Model commands live in model/kimi_k3/cli.py.
"""
