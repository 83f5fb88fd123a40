"""Validates vbatch's JSON against OpenAI's own schemas (tests/data/openai-batch-schemas.yaml, copied from
../shared/openai: the official OpenAPI blocks for Files and Batches, and the batch line formats)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import jsonschema
import yaml
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SCHEMAS = Path(__file__).parent / "data" / "openai-batch-schemas.yaml"


@cache
def _documents() -> list[dict]:
    return list(yaml.safe_load_all(SCHEMAS.read_text()))


def _drop_nulls(instance: object, schema: dict, root: dict) -> object:
    """The spec types optional fields as non-nullable yet its own examples carry null: null means absent."""
    if "$ref" in schema:
        schema = _resolve(schema["$ref"], root)
    if isinstance(instance, dict) and "properties" in schema:
        required = set(schema.get("required", []))
        return {
            key: _drop_nulls(value, schema["properties"].get(key, {}), root)
            for key, value in instance.items()
            if value is not None or key in required
        }
    if isinstance(instance, list) and "items" in schema:
        return [_drop_nulls(item, schema["items"], root) for item in instance]
    return instance


def _resolve(ref: str, root: dict) -> dict:
    node: dict = root
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def validate(instance: object, name: str, *, document: int = 0) -> None:
    root = _documents()[document]
    schema = root["components"]["schemas"][name]
    resource = Resource.from_contents(root, default_specification=DRAFT202012)
    registry = Registry().with_resource("urn:openai", resource)
    wrapped = {"$ref": f"urn:openai#/components/schemas/{name}"}
    validator = jsonschema.Draft202012Validator(wrapped, registry=registry)
    validator.validate(_drop_nulls(instance, schema, root))
