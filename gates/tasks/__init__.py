"""The agent-task workflow: the template schema (agent_tasks/<name>.yaml + <name>.md) and loading (schema.py),
`k3forge task check` against a branch's commits with its PR summary (check.py), `k3forge task new` (scaffold.py),
and their jinja2 templates (render.py, templates/).

Not here: which paths a task may change (gates.scope) and how evidence is verified (gates.evidence).
"""
