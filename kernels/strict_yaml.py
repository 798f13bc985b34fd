"""YAML as the gates read it (contracts, task templates): a key twice in one mapping is an error, where PyYAML
keeps the last one silently (a contract stating a bound twice would mean whichever came second), and a syntax
error is one problem on one line, with its line and column."""

from __future__ import annotations

from collections.abc import Hashable

import yaml
from yaml.constructor import ConstructorError


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        self.flatten_mapping(node)  # merge keys (<<) first: a merged default may be overridden
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # PyYAML's own construct_mapping rejects it, with its message
            if key in seen:
                raise ConstructorError(None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(text: str) -> object:
    """The document in `text`; yaml.YAMLError for a syntax error or a duplicate key."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader


def yaml_problem(e: yaml.YAMLError) -> str:
    """One line: what is wrong and where (line and column, counted from 1)."""
    what = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return f"{what} at line {mark.line + 1}, column {mark.column + 1}" if mark else what
