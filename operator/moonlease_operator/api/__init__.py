"""The operator's custom resources as pydantic models (pure; the CRD is generated from them)."""

from moonlease_operator.api.abtest import ABTestPhase, ABTestSpec, ABTestStatus
from moonlease_operator.api.common import (
    CelRule,
    Condition,
    ConditionStatus,
    LabelSelector,
    LabelSelectorRequirement,
    SelectorOperator,
)
from moonlease_operator.api.policy import (
    AB_DECISION_ANNOTATION,
    API_VERSION,
    APPROVE_MASTER_RESTART_ANNOTATION,
    DEFAULT_STAGES,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    ConditionType,
    ConnectorSpec,
    FailurePolicy,
    LeaseMode,
    MasterConfigMapSpec,
    MasterSpec,
    Phase,
    PolicySpec,
    PolicySpecError,
    PolicyStatus,
    Reason,
    Role,
    RolloutSpec,
    RolloutStrategy,
    StageName,
    StagePhase,
    StageStatus,
    TargetPhase,
    TargetSpec,
    TargetStatus,
    WorkloadKind,
    build_master_flags,
    parse_spec,
    read_spec,
)

__all__ = [
    "AB_DECISION_ANNOTATION", "ABTestPhase", "ABTestSpec", "ABTestStatus", "API_VERSION", "APPROVE_MASTER_RESTART_ANNOTATION", "MasterConfigMapSpec", "DEFAULT_STAGES", "GROUP", "KIND", "PLURAL", "VERSION",
    "CelRule", "Condition", "ConditionStatus", "ConditionType", "ConnectorSpec", "FailurePolicy",
    "LabelSelector", "LabelSelectorRequirement", "LeaseMode", "MasterSpec", "Phase", "PolicySpec",
    "PolicySpecError", "PolicyStatus", "Reason", "Role", "RolloutSpec", "RolloutStrategy",
    "SelectorOperator", "StageName", "StagePhase", "StageStatus", "TargetPhase", "TargetSpec",
    "TargetStatus", "WorkloadKind", "build_master_flags", "parse_spec", "read_spec",
]
