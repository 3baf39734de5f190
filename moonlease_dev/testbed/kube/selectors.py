"""Label and field selectors as the API server parses and matches them. Pure functions."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

@dataclass(frozen=True)
class SelectorTerm:
    """One term of a label selector string: `key op values`."""

    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!exists"
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        match self.op:
            case "=":
                return present and labels[self.key] in self.values
            case "!=":
                return not present or labels[self.key] not in self.values
            case "in":
                return present and labels[self.key] in self.values
            case "notin":
                return not present or labels[self.key] not in self.values
            case "exists":
                return present
            case _:
                return not present


_SET_TERM = re.compile(r"^\s*(!?)\s*([^\s!=,()]+)\s*(?:(in|notin)\s*\(([^)]*)\)|(==|=|!=)\s*([^\s,]*))?\s*$")


def parse_label_selector(text: str) -> tuple[SelectorTerm, ...]:
    """Parse `a=b,c!=d,e in (x,y),f notin (z),g,!h` (kubectl's syntax); raises ValueError."""
    terms: list[SelectorTerm] = []
    for raw in _split_selector(text):
        match = _SET_TERM.match(raw)
        if not match:
            raise ValueError(f"unable to parse requirement: {raw!r}")
        neg, key, set_op, set_values, eq_op, eq_value = match.groups()
        if set_op:
            values = frozenset(v.strip() for v in set_values.split(",") if v.strip())
            terms.append(SelectorTerm(key, set_op, values))
        elif eq_op:
            terms.append(SelectorTerm(key, "!=" if eq_op == "!=" else "=", frozenset({eq_value})))
        else:
            terms.append(SelectorTerm(key, "!exists" if neg else "exists"))
    return tuple(terms)


def _split_selector(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p for p in parts if p.strip()]


def match_label_selector(terms: Iterable[SelectorTerm], labels: Mapping[str, str]) -> bool:
    return all(term.matches(labels) for term in terms)


@dataclass(frozen=True)
class FieldTerm:
    """One term of a field selector: `path op value`, with op "=" or "!="."""

    path: str
    op: str
    value: str

    def matches(self, obj: Mapping[str, Any]) -> bool:
        value: Any = obj
        for part in self.path.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if isinstance(value, bool):
            actual = "true" if value else "false"
        else:
            actual = "" if value is None else str(value)
        return (actual == self.value) == (self.op == "=")


def parse_field_selector(text: str) -> tuple[FieldTerm, ...]:
    """Parse `metadata.name=x,involvedObject.kind!=Pod` (`=`, `==`, `!=` only); raises ValueError."""
    terms = []
    for raw in _split_selector(text):
        for op, canonical in (("!=", "!="), ("==", "="), ("=", "=")):
            if op in raw:
                path, _, value = raw.partition(op)
                if not path.strip() or any(c in value for c in "=!"):
                    raise ValueError(f"invalid selector: {text!r}")
                terms.append(FieldTerm(path.strip(), canonical, value.strip()))
                break
        else:
            raise ValueError(f"invalid selector: {text!r}; can't understand {raw.strip()!r}")
    return tuple(terms)


def match_field_selector(text: str | Iterable[FieldTerm], obj: Mapping[str, Any]) -> bool:
    """Whether `obj` matches a field selector (its text or parsed terms); dotted paths are
    compared as strings."""
    terms = parse_field_selector(text) if isinstance(text, str) else tuple(text)
    return all(term.matches(obj) for term in terms)
