"""The jinja2 templates under gates/tasks/templates/: the files `task new` scaffolds and the PR summary."""

from __future__ import annotations

from pathlib import Path

import yaml
from jinja2 import Environment, FileSystemLoader, StrictUndefined

TEMPLATES = Path(__file__).with_name("templates")


def _env() -> Environment:
    env = Environment(loader=FileSystemLoader(TEMPLATES), undefined=StrictUndefined, trim_blocks=True,
                      lstrip_blocks=True, keep_trailing_newline=True)
    env.filters.update(
        md_cell=lambda v: str(v).replace("|", "\\|").replace("\n", " "),
        short=lambda sha: sha[:12],
        flow=lambda v: yaml.safe_dump(v, default_flow_style=True, sort_keys=False, width=1000).removesuffix(
            "...\n").strip(),  # YAML in one line; a scalar's document-end marker dropped
    )
    return env


def render(template: str, **context) -> str:
    return _env().get_template(template).render(**context)
