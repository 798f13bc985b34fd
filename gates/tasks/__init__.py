"""Agent task templates and the PR scope policy.

    schema.py    the template schema (agent_tasks/<name>.yaml + <name>.md), loading, the path policy
    check.py     `k3forge task check`: a branch's commits against its task's rules, with a PR summary
    scaffold.py  `k3forge task new`: a contract draft, a kernel module and a test, inside the task's paths
"""
