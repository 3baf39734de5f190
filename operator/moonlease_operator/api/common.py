"""Building blocks shared by the custom resources: the model base, CEL rules, label selectors,
conditions.

Pure: imports neither kopf nor the Kubernetes client. The CRD schema is generated from these
models (see `moonlease_operator.crd`), so every constraint here reaches the API server.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

#: A DNS-1123 subdomain: the names of Deployments, StatefulSets and most other objects.
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
#: A DNS-1123 label: the names of containers.
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"

#: A label key (optional DNS-subdomain prefix and `/`, then a name) and a label value, as the API
#: server validates them on every object: ASCII only, so a selector that could never match any
#: workload (`ø` in a key or value) is refused when the policy is written, not waited on forever.
LABEL_KEY_PATTERN = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                     r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
LabelKey = Annotated[str, Field(min_length=1, max_length=317, pattern=LABEL_KEY_PATTERN)]
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]

ObjectName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)]
ContainerName = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN)]


@dataclass(frozen=True)
class CelRule:
    """One `x-kubernetes-validations` entry, and the message its pydantic mirror raises.

    The API server evaluates `rule`; jsonschema and the operator cannot, so each model that
    declares a rule also checks it in a validator with the same message (tests keep the two
    in step). `field_path` points kubectl users at the offending field.
    """

    rule: str
    message: str
    field_path: str | None = None

    def as_schema(self) -> dict[str, str]:
        entry = {"rule": self.rule, "message": self.message}
        if self.field_path is not None:
            entry["fieldPath"] = self.field_path
        return entry

    def violation(self) -> PydanticCustomError:
        """The pydantic error for this rule (no "Value error," prefix, same text as the API)."""
        return PydanticCustomError("cel_rule", self.message)


def _add_cel_rules(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """Pydantic schema hook: copy a model's `cel_rules` into its schema."""
    rules: tuple[CelRule, ...] = getattr(cls, "cel_rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [rule.as_schema() for rule in rules]


class ApiModel(BaseModel):
    """Base of every spec model: camelCase in YAML, snake_case in Python, unknown keys refused.

    The API server prunes unknown fields (or refuses them with kubectl's strict field validation);
    refusing them here too catches typos when the operator meets an object that bypassed it.
    Subclasses list their CEL rules in `cel_rules`; `crd.build_crd()` copies them to the schema.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        json_schema_extra=_add_cel_rules,
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = ()


class StatusModel(ApiModel):
    """Base of the status models: written by the operator, read back tolerantly."""

    model_config = ConfigDict(extra="ignore")


class SelectorOperator(str, enum.Enum):
    """The set-based operators of a Kubernetes label selector."""

    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


_VALUES_RULE = CelRule(
    rule="self.operator in ['In', 'NotIn'] ? (has(self.values) && size(self.values) > 0)"
    " : (!has(self.values) || size(self.values) == 0)",
    message="values must be non-empty for In and NotIn, and empty for Exists and DoesNotExist",
)


class LabelSelectorRequirement(ApiModel):
    """A set-based label requirement, as in `metav1.LabelSelectorRequirement`."""

    key: LabelKey
    operator: SelectorOperator
    values: Annotated[list[LabelValue], Field(max_length=64)] | None = None

    cel_rules: ClassVar[tuple[CelRule, ...]] = (_VALUES_RULE,)

    @model_validator(mode="after")
    def _check_values(self) -> LabelSelectorRequirement:
        needs_values = self.operator in (SelectorOperator.IN, SelectorOperator.NOT_IN)
        if needs_values != bool(self.values):
            raise _VALUES_RULE.violation()
        return self


_NON_EMPTY_SELECTOR_RULE = CelRule(
    rule="(has(self.matchLabels) && size(self.matchLabels) > 0)"
    " || (has(self.matchExpressions) && size(self.matchExpressions) > 0)",
    message="a selector must match on at least one label (an empty selector selects everything)",
)


# A CRD schema cannot constrain map keys (no patternProperties): a CEL rule does.
_LABEL_KEYS_RULE = CelRule(
    rule="!has(self.matchLabels) || self.matchLabels.all(k, size(k) <= 317 && k.matches("
    + json.dumps(LABEL_KEY_PATTERN) + "))",
    message="matchLabels keys must be Kubernetes label keys: ASCII letters, digits, '-', '_' and '.'"
            " (an optional DNS prefix and '/' before them)",
)
_LABEL_KEY = re.compile(LABEL_KEY_PATTERN, re.ASCII)


class LabelSelector(ApiModel):
    """A Kubernetes label selector. An empty one is refused: it would select every workload."""

    match_labels: Annotated[dict[str, LabelValue], Field(max_length=32)] | None = None
    match_expressions: Annotated[list[LabelSelectorRequirement], Field(max_length=16)] | None = None

    cel_rules: ClassVar[tuple[CelRule, ...]] = (_NON_EMPTY_SELECTOR_RULE, _LABEL_KEYS_RULE)

    @model_validator(mode="after")
    def _check_non_empty(self) -> LabelSelector:
        if not self.match_labels and not self.match_expressions:
            raise _NON_EMPTY_SELECTOR_RULE.violation()
        if not all(len(k) <= 317 and _LABEL_KEY.match(k) for k in self.match_labels or {}):
            raise _LABEL_KEYS_RULE.violation()
        return self

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether an object with these labels is selected (Kubernetes semantics)."""
        for key, value in (self.match_labels or {}).items():
            if labels.get(key) != value:
                return False
        for req in self.match_expressions or ():
            present = req.key in labels
            match req.operator:
                case SelectorOperator.IN:
                    ok = present and labels[req.key] in (req.values or ())
                case SelectorOperator.NOT_IN:
                    ok = not present or labels[req.key] not in (req.values or ())
                case SelectorOperator.EXISTS:
                    ok = present
                case SelectorOperator.DOES_NOT_EXIST:
                    ok = not present
            if not ok:
                return False
        return True


class ConditionStatus(str, enum.Enum):
    """The three values Kubernetes allows in `condition.status`."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


_REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
_TYPE_PATTERN = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"


class Condition(StatusModel):
    """A status condition as in metav1.Condition; lastTransitionTime changes only when status
    does, so it tells how long the state has held."""

    type: Annotated[str, Field(max_length=316, pattern=_TYPE_PATTERN)]
    status: ConditionStatus
    reason: Annotated[str, Field(min_length=1, max_length=1024, pattern=_REASON_PATTERN)]
    message: Annotated[str, Field(max_length=32768)] = ""
    last_transition_time: datetime
    observed_generation: Annotated[int, Field(ge=0)] | None = None
