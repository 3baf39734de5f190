"""The operator's custom resources as pydantic models (pure; the CRD is generated from them)."""

from moonlease_operator.api.abtest import ABTestSpec
from moonlease_operator.api.abtest_status import ABTestPhase, ABTestStatus
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
    VERB_ANNOTATION,
    VERSION,
    ConnectorSpec,
    FailurePolicy,
    LeaseMode,
    MasterConfigMapSpec,
    MasterDeletionPolicy,
    MasterSpec,
    PolicySpec,
    PolicySpecError,
    Role,
    RolloutSpec,
    RolloutStrategy,
    StageName,
    TargetSpec,
    Verb,
    VerbOutcome,
    WorkloadKind,
    build_master_flags,
    parse_spec,
    read_spec,
)
from moonlease_operator.api.status import (
    ConditionType,
    ConflictStatus,
    Phase,
    PolicyStatus,
    Reason,
    StagePhase,
    StageStatus,
    TargetCount,
    TargetPhase,
    TargetStatus,
    VerbRecord,
)

__all__ = [
    "AB_DECISION_ANNOTATION", "ABTestPhase", "ABTestSpec", "ABTestStatus", "API_VERSION", "APPROVE_MASTER_RESTART_ANNOTATION", "MasterConfigMapSpec", "MasterDeletionPolicy", "DEFAULT_STAGES", "GROUP", "KIND", "PLURAL", "VERSION",
    "CelRule", "Condition", "ConditionStatus", "ConditionType", "ConnectorSpec", "FailurePolicy",
    "LabelSelector", "LabelSelectorRequirement", "LeaseMode", "MasterSpec", "Phase", "PolicySpec",
    "PolicySpecError", "PolicyStatus", "Reason", "Role", "RolloutSpec", "RolloutStrategy",
    "SelectorOperator", "StageName", "StagePhase", "StageStatus", "TargetPhase", "TargetSpec",
    "TargetCount", "TargetStatus", "VERB_ANNOTATION", "Verb", "VerbOutcome", "VerbRecord", "ConflictStatus", "WorkloadKind", "build_master_flags", "parse_spec", "read_spec",
]
