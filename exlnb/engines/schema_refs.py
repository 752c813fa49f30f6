"""Whether a JSON schema's `$ref`s leave it an answer of finite length.

llguidance accepts a schema whose references loop with nothing to end them (`"x": {"$ref": "#"}` with `x`
required, or two definitions that only name each other) and fails only while sampling, inside an engine step:
"Too many items (limit 50000; ff_tokens)" or "NoExtensionBias". So the loop is found where the schema is given.
Recursion that can stop (an optional property, an array that may be empty) is fine, and llguidance follows it.
"""

from __future__ import annotations

from urllib.parse import unquote


def check_references_end(schema: dict) -> None:
    """Refuse, in one line, a schema with a local `$ref` that no finite JSON value satisfies."""
    refs = sorted(set(_local_refs(schema)))
    finite: set[str] = set()
    grew = True
    while grew:  # least fixed point: a reference is finite once what it points at is, given those known so
        grew = False
        for ref in refs:
            if ref not in finite and _has_finite_value(_resolve(schema, ref), schema, finite):
                finite.add(ref)
                grew = True
    endless = [ref for ref in refs if ref not in finite]
    if endless:
        raise ValueError(
            f"json_schema's {endless[0]!r} refers back to itself with nothing to end it, so no answer could ever "
            "finish: make the recursive property optional (leave it out of required), or let its array be empty"
        )


def _local_refs(node: object):
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            yield ref
        for value in node.values():
            yield from _local_refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _local_refs(value)


def _resolve(root: dict, ref: str) -> object:
    """The schema a JSON pointer (`#/$defs/a~1b`) names; True (anything) for an anchor or a pointer that does
    not resolve, which llguidance judges itself."""
    if ref != "#" and not ref.startswith("#/"):
        return True
    node: object = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return True
    return node


def _has_finite_value(node: object, root: dict, finite: set[str]) -> bool:
    """Whether some finite JSON value fits `node`, counting only what forces nesting (required properties,
    non-empty arrays, references); `finite` holds the references known to have one."""
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in finite:
        return False
    if not all(_has_finite_value(sub, root, finite) for sub in node.get("allOf", [])):
        return False
    for key in ("anyOf", "oneOf"):
        if node.get(key) and not any(_has_finite_value(sub, root, finite) for sub in node[key]):
            return False
    properties = node.get("properties", {})
    if not all(_has_finite_value(properties.get(name, True), root, finite) for name in node.get("required", [])):
        return False
    least = node.get("minItems", 0)
    prefix = node.get("prefixItems", [])
    if not all(_has_finite_value(sub, root, finite) for sub in prefix[:least]):
        return False
    return least <= len(prefix) or _has_finite_value(node.get("items", True), root, finite)
