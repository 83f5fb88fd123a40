"""Every route of the HTTP API, from the OpenAPI document the app serves (`app.openapi`, which `openapi.yaml`
equals): its parameters, body and answers, and every schema they name."""

from __future__ import annotations

from collections.abc import Iterator

from app.openapi import served_openapi
from app.reference.markdown import cell, code, generated, table

METHODS = ("get", "post", "put", "patch", "delete")


def operations(document: dict) -> Iterator[tuple[str, str, dict]]:
    """(METHOD, path, operation) in the document's order."""
    for path, item in document.get("paths", {}).items():
        for method in METHODS:
            if method in item:
                yield method.upper(), path, item[method]


def heading(method: str, path: str) -> str:
    return f"### `{method} {path}`"


def schema_anchor(name: str) -> str:
    return f"schema-{name.lower()}"


def type_of(schema: dict) -> str:
    """A schema as a short type: a link for a named schema, `a | b` for anyOf, `array of x`, an enum's values."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{schema_anchor(name)})"
    for combined in ("anyOf", "oneOf"):
        if combined in schema:
            return " \\| ".join(type_of(each) for each in schema[combined])
    if "const" in schema:
        return code(repr(schema["const"]).replace("'", '"'))
    if "enum" in schema:
        return " \\| ".join(code(value) for value in schema["enum"])
    kind = schema.get("type", "object" if "properties" in schema else "any")
    if kind == "array":
        return f"array of {type_of(schema.get('items', {}))}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"map of {type_of(schema['additionalProperties'])}"
    return cell(kind)


def _parameters(operation: dict) -> str:
    rows = [
        (
            code(p["name"]),
            p.get("in", ""),
            "yes" if p.get("required") else "",
            type_of(p.get("schema", {})),
            cell(p.get("description") or p.get("schema", {}).get("description", "")),
        )
        for p in operation.get("parameters", [])
    ]
    return "**Parameters**\n\n" + table(("name", "in", "required", "type", "what"), rows) if rows else ""


def _body(operation: dict) -> str:
    body = operation.get("requestBody")
    if not body:
        return ""
    parts = []
    for media, content in body.get("content", {}).items():
        schema = content.get("schema", {})
        parts.append(f"**Body** ({code(media)}): {type_of(schema)}")
        if "properties" in schema:
            parts.append(_properties(schema))
        elif schema.get("description"):
            parts.append(cell(schema["description"]))
    return "\n\n".join(parts) + "\n"


def _responses(operation: dict) -> str:
    rows = []
    for status, answer in operation.get("responses", {}).items():
        kinds = [
            f"{type_of(content.get('schema', {}))} ({code(media)})"
            for media, content in answer.get("content", {}).items()
        ]
        rows.append((code(status), cell(answer.get("description", "")), "<br>".join(kinds)))
    return "**Answers**\n\n" + table(("status", "when", "body"), rows)


def _operation(method: str, path: str, operation: dict) -> str:
    needs_key = (
        "Needs a key (`Authorization: Bearer KEY`) when keys are configured."
        if operation.get("security")
        else "Needs no key."
    )
    parts = [heading(method, path), cell(operation.get("summary", ""))]
    if operation.get("description"):
        parts.append(operation["description"].strip())
    parts += [needs_key, _parameters(operation), _body(operation), _responses(operation)]
    return "\n\n".join(part.rstrip("\n") for part in parts if part) + "\n"


def _properties(schema: dict) -> str:
    required = set(schema.get("required", []))
    rows = [
        (code(name), type_of(prop), "yes" if name in required else "", cell(prop.get("description", "")))
        for name, prop in schema.get("properties", {}).items()
    ]
    return table(("field", "type", "required", "what"), rows)


def _schema(name: str, schema: dict) -> str:
    parts = [f"### {name} {{#{schema_anchor(name)}}}"]
    if schema.get("description"):
        parts.append(cell(schema["description"]))
    if "properties" in schema:
        parts.append(_properties(schema))
    else:
        parts.append(f"Type: {type_of(schema)}")
    return "\n\n".join(part.rstrip("\n") for part in parts) + "\n"


def page(document: dict | None = None) -> str:
    document = document or served_openapi()
    by_tag: dict[str, list[str]] = {}
    for method, path, operation in operations(document):
        tag = (operation.get("tags") or ["service"])[0]
        by_tag.setdefault(tag, []).append(_operation(method, path, operation))
    sections = [f"## {tag.capitalize()}\n\n" + "\n".join(ops) for tag, ops in by_tag.items()]
    schemas = document.get("components", {}).get("schemas", {})
    return (
        "# HTTP API\n\n"
        + generated("the OpenAPI document the app serves, `openapi.yaml`")
        + "Every route, its parameters and answers, from the OpenAPI document the app serves (`openapi.yaml` in the "
        "repository; [download it](../openapi.yaml), or browse it in the [interactive view](http-explorer.md)). "
        'All API routes are under `/v1`: point an OpenAI SDK at `base_url="http://HOST:8000/v1"`. Every answer '
        'that is not a 2xx carries OpenAI\'s error envelope `{"error": {"message", "type", "param", '
        '"code"}}`: the codes are listed in [Error codes](errors.md).\n\n'
        + "\n".join(sections)
        + "\n## Schemas\n\n"
        + "\n".join(_schema(name, schema) for name, schema in schemas.items())
    )
