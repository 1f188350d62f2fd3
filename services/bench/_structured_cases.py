"""30 varied JSON schemas (nesting, enums, patterns, bounded arrays, refs, unions): shared by
the structured-output tests and `sluice bench structured`."""

from __future__ import annotations

OBJ = "object"


def obj(props: dict, required: list[str] | None = None, **kw) -> dict:
    return {
        "type": OBJ,
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
        **kw,
    }


S = {"type": "string", "maxLength": 12}
I = {"type": "integer", "minimum": -1000, "maximum": 1000}  # noqa: E741

SCHEMAS: list[dict] = [
    obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 150}}),
    obj({"ok": {"type": "boolean"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}),
    obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}),
    obj({"point": obj({"x": I, "y": I})}),
    obj({"a": obj({"b": obj({"c": obj({"d": {"type": "boolean"}})})})}),
    obj({"items": {"type": "array", "items": obj({"id": I, "label": S}), "maxItems": 2}}),
    obj({"v": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    obj({"kind": {"const": "fixed"}, "n": I}),
    obj({"x": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"enum": ["none"]}]}}),
    obj({"id": {"type": "string", "pattern": "^[a-f0-9]{8}$"}}),
    obj({"price": {"type": "number", "minimum": 0, "maximum": 100}}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": I, "maxItems": 2}, "maxItems": 2}}),
    obj({"opt": S, "req": {"type": "boolean"}}, required=["req"]),
    {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 2, "maxItems": 4},
    {"type": "string", "pattern": "^(yes|no|maybe)$"},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"enum": ["alpha", "beta", 3, None, True]},
    obj(
        {"user": {"$ref": "#/$defs/user"}},
        **{"$defs": {"user": obj({"name": S, "admin": {"type": "boolean"}})}},
    ),
    obj({"date": {"type": "string", "format": "date"}}),
    obj({"email": {"type": "string", "format": "email", "maxLength": 40}}),
    obj({"uuid": {"type": "string", "format": "uuid"}}),
    obj(
        {
            "status": {"enum": ["active", "inactive"]},
            "since": {"type": "integer", "minimum": 1970, "maximum": 2100},
        }
    ),
    obj({"word": {"type": "string", "minLength": 2, "maxLength": 5, "pattern": "^[a-z]+$"}}),
    obj({"pair": {"type": "array", "prefixItems": [S, I], "items": False, "minItems": 2}}),
    obj({"shape": {"oneOf": [obj({"circle": I}), obj({"square": I})]}}),
    obj(
        {
            "meta": obj(
                {
                    "version": {"type": "string", "pattern": "^v[0-9]\\.[0-9]$"},
                    "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                }
            )
        }
    ),
    obj({"ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}}),
    obj({"n": {"type": "null"}, "s": {"type": "string", "enum": ['a"b', "c\\d", "é"]}}),
]
assert len(SCHEMAS) == 30
