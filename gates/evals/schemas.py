"""JSON schemas of growing difficulty for the structured-output eval.

Random weights follow the grammar anywhere it lets them, so every schema is finite: strings are enums,
patterns or bounded by maxLength, arrays by maxItems, integers by a range, and no object admits extra
properties. The grammar is compiled without free whitespace, so the longest valid output is a few
hundred bytes and a greedy decode must close within `max_tokens`.
"""

from __future__ import annotations

from typing import Any


def _object(properties: dict[str, Any], title: str | None = None) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}
    return {"title": title, **schema} if title else schema


SKU = {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}

SCHEMAS: dict[str, dict[str, Any]] = {
    "enum": _object({"color": {"enum": ["red", "green", "blue"]}}, "a color"),
    "scalars": _object({
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "active": {"type": "boolean"},
    }, "a user"),
    "nested": _object({
        "user": _object({"id": {"type": "integer", "minimum": 1, "maximum": 99999},
                         "role": {"enum": ["admin", "editor", "viewer"]}}),
        "address": _object({"city": {"type": "string", "maxLength": 16},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    }, "an account"),
    "arrays": _object({
        "tags": {"type": "array", "items": {"enum": ["new", "sale", "hot"]}, "minItems": 1, "maxItems": 3},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                   "minItems": 2, "maxItems": 4},
    }, "a review"),
    "patterns": _object({
        "sku": SKU,
        "date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"},
        "version": {"type": "string", "pattern": "^v[0-9]\\.[0-9]{1,2}$"},
    }, "a release"),
    "order": _object({
        "id": SKU,
        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": _object({"sku": SKU, "qty": {"type": "integer", "minimum": 1, "maximum": 9}})},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "priority": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 1, "maximum": 5}]},
    }, "an order"),
}
