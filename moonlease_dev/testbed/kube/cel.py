"""A CRD schema's CEL rules (`x-kubernetes-validations`) evaluated as the API server evaluates them
at admission, with cel-python. Pure (no I/O), but it needs cel-python (a dev dependency, as the
whole test bed's kmock is), imported when the first rule is compiled.

- Each rule runs with `self` bound to the node of the schema that declares it (once per list
  item, per map value), on the defaulted object; `oldSelf` (transition rules) only on updates
  where the node existed before, and transition rules are skipped otherwise.
- Ratcheting (on by default since Kubernetes 1.30): on an update, a rule whose node is unchanged
  is not evaluated again, so a status write never trips a spec rule.
- A rule that is false, or fails to evaluate, is a field error at the node's path plus the rule's
  `fieldPath`, of the rule's `reason` (default FieldValueInvalid), with its `message` (or the
  result of `messageExpression`, else "failed rule: <rule>"): the API server's 422 lines, e.g.
  `spec.targets[0]: Invalid value: "object": exactly one of name or selector`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from moonlease_dev.testbed.kube.validation import ErrorType, FieldError

JsonObj = dict[str, Any]

_MISSING = object()
_PROGRAMS: dict[str, Any] = {}


def _program(expression: str) -> Any:
    """A compiled rule (cached: every admission of a kind runs the same few rules)."""
    if expression not in _PROGRAMS:
        import celpy

        environment = celpy.Environment()
        _PROGRAMS[expression] = environment.program(environment.compile(expression))
    return _PROGRAMS[expression]


def _nodes(node: Any, old: Any, schema: Mapping[str, Any], path: str) -> Iterator[tuple[Any, Any, Mapping[str, Any], str]]:
    """(node, old node or _MISSING, its schema, its path) for every node under `schema`."""
    yield node, old, schema, path
    if isinstance(node, Mapping):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        old_map = old if isinstance(old, Mapping) else {}
        for key, value in node.items():
            sub = properties.get(key, extra if isinstance(extra, Mapping) else None)
            if isinstance(sub, Mapping):
                step = f"{path}.{key}" if key in properties else f"{path}[{key}]"
                yield from _nodes(value, old_map.get(key, _MISSING), sub, step.lstrip("."))
    elif isinstance(node, list) and isinstance(schema.get("items"), Mapping):
        old_list = old if isinstance(old, list) else []
        for index, item in enumerate(node):
            before = old_list[index] if index < len(old_list) else _MISSING
            yield from _nodes(item, before, schema["items"], f"{path}[{index}]")


def _error_type(reason: str | None) -> ErrorType:
    return {"FieldValueRequired": ErrorType.REQUIRED, "FieldValueForbidden": ErrorType.FORBIDDEN,
            "FieldValueDuplicate": ErrorType.DUPLICATE}.get(reason or "", ErrorType.INVALID)


def _passes(rule: Mapping[str, Any], bindings: JsonObj) -> bool:
    import celpy

    try:
        result = _program(rule["rule"]).evaluate(bindings)
    except celpy.CELEvalError:
        return False
    return isinstance(result, celpy.celtypes.BoolType) and bool(result)


def _message(rule: Mapping[str, Any], bindings: JsonObj) -> str:
    if rule.get("message"):
        return str(rule["message"])
    if rule.get("messageExpression"):
        import celpy

        try:
            return str(_program(rule["messageExpression"]).evaluate(bindings))
        except celpy.CELEvalError:
            pass
    return f"failed rule: {rule['rule']}"


def rule_errors(obj: Any, schema: Mapping[str, Any], old: Any = None) -> list[FieldError]:
    """The CEL rules of `schema` that `obj` (defaulted) breaks; `old`: the stored object on an
    update (transition rules and ratcheting), None on a create."""
    import celpy

    failures = []
    for node, before, sub, path in _nodes(obj, _MISSING if old is None else old, schema, ""):
        rules = sub.get("x-kubernetes-validations") or []
        if not rules or (before is not _MISSING and before == node):
            continue  # no rules here, or ratcheted: unchanged since the stored version
        bindings: JsonObj = {"self": celpy.json_to_cel(node)}
        if before is not _MISSING:
            bindings["oldSelf"] = celpy.json_to_cel(before)
        for rule in rules:
            if "oldSelf" in rule["rule"] and "oldSelf" not in bindings:
                continue  # a transition rule on a create (or a new node)
            if not _passes(rule, bindings):
                where = (path + rule.get("fieldPath", "")).lstrip(".") or "<root>"
                failures.append(FieldError(where, _error_type(rule.get("reason")), _message(rule, bindings),
                                           sub.get("type", "object")))
    return failures
