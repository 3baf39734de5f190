{{/*
Rules across values that the schema cannot express. Each failure says what to change.
Included once, by validate.yaml (which renders nothing).
*/}}
{{- define "moonlease.validate" -}}
{{- $m := .Values.mooncake -}}
{{- if and (not $m.master.enabled) (not $m.master.externalAddress) -}}
{{- fail "mooncake.master.externalAddress (host:port) is required when mooncake.master.enabled is false: the store pool and the engines connect to it" -}}
{{- end -}}
{{- if and $m.master.enabled $m.master.externalAddress -}}
{{- fail "mooncake.master.externalAddress is for a master outside this release: set mooncake.master.enabled=false to use it, or leave it empty" -}}
{{- end -}}
{{- range $kind := list "requests" "limits" -}}
{{- if hasKey (index $m.storePool.resources $kind | default dict) "memory" -}}
{{- fail (printf "mooncake.storePool.resources.%s.memory must not be set: a pool pod's memory is globalSegmentSizeMiB + localBufferSizeMiB + memoryOverheadMiB" $kind) -}}
{{- end -}}
{{- end -}}
{{- if and (has "*" .Values.operator.watchNamespaces) (gt (len .Values.operator.watchNamespaces) 1) -}}
{{- fail "operator.watchNamespaces: \"*\" (every namespace) stands alone; list namespaces or give [\"*\"]" -}}
{{- end -}}
{{- if and .Values.router.enabled (not .Values.vllm.enabled) -}}
{{- fail "router.enabled puts vllm-router in front of this release's prefill and decode engines: it needs vllm.enabled true" -}}
{{- end -}}
{{- if and .Values.router.enabled .Values.vllm.enabled (not .Values.router.image.repository) -}}
{{- fail "router.image.repository is required with router.enabled: an image with vllm-router on PATH (no image of this chart ships it; e.g. python:3.11-slim plus pip install vllm-router==0.1.17)" -}}
{{- end -}}
{{- $fleetImage := .Values.fleetOrder.image -}}
{{- if and .Values.fleetOrder.enabled $fleetImage.repository (not $fleetImage.tag) (not $fleetImage.digest) -}}
{{- fail "fleetOrder.image.repository needs fleetOrder.image.tag or digest (or leave the repository empty: the service runs vllm.image, the connector image)" -}}
{{- end -}}
{{- $modes := list .Values.vllm.connector.leaseMode -}}
{{- range .Values.vllm.arms -}}
{{- $modes = append $modes (default $.Values.vllm.connector.leaseMode .leaseMode) -}}
{{- end -}}
{{- if and (has "lastHitOnly" $modes) (not .Values.vllm.hybrid) -}}
{{- fail "leaseMode lastHitOnly is for hybrid models (full attention + align-mode Mamba): set vllm.hybrid=true for such a model, or choose leaseAll or selective" -}}
{{- end -}}
{{- if and (.Values.vllm.connector.retention | default dict).pin (eq (toString (index $m.master.settings "allow_evict_soft_pinned_objects")) "false") -}}
{{- fail "vllm.connector.retention.pin needs mooncake.master.settings.allow_evict_soft_pinned_objects true (Mooncake's default): with false, pinned objects leave only when their pin expires and a full store refuses puts" -}}
{{- end -}}
{{- $evict := (.Values.vllm.connector.retention | default dict).evict -}}
{{- range .Values.vllm.arms -}}
{{- if (.retention | default dict).evict -}}
{{- $evict = true -}}
{{- end -}}
{{- end -}}
{{- if and $evict (kindIs "invalid" (index $m.master.settings "eviction_high_watermark_ratio")) -}}
{{- fail "vllm.connector.retention.evict keeps the store under the master's eviction watermark: set mooncake.master.settings.eviction_high_watermark_ratio (Mooncake's default is 0.9)" -}}
{{- end -}}
{{- $watermark := index $m.master.settings "eviction_high_watermark_ratio" -}}
{{- $storeFull := .Values.monitoring.prometheusRule.storeFullRatio -}}
{{- if and .Values.monitoring.prometheusRule.enabled (not (kindIs "invalid" $watermark)) (not (kindIs "invalid" $storeFull)) (le (float64 $storeFull) (float64 $watermark)) -}}
{{- fail (printf "monitoring.prometheusRule.storeFullRatio (%v) must be above mooncake.master.settings.eviction_high_watermark_ratio (%v): the master keeps the store at its watermark, so the alert would fire on a healthy store" .Values.monitoring.prometheusRule.storeFullRatio $watermark) -}}
{{- end -}}
{{- $names := list -}}
{{- range .Values.vllm.arms -}}
{{- if has .name $names -}}
{{- fail (printf "vllm.arms: the arm name %q is used twice" .name) -}}
{{- end -}}
{{- $names = append $names .name -}}
{{- end -}}
{{- if .Values.policy.enabled -}}
{{- $arms := (include "moonlease.arms" . | fromJson).arms -}}
{{- $managed := 0 -}}
{{- if .Values.vllm.enabled -}}
{{- range $arms -}}
{{- if .managed -}}
{{- $managed = add1 $managed -}}
{{- if ne .leaseMode $.Values.vllm.connector.leaseMode -}}
{{- fail (printf "vllm.arms: arm %q sets leaseMode %s but the policy (which sets vllm.connector.leaseMode=%s on its targets) manages it: set managedByPolicy: false on the arm" .name .leaseMode $.Values.vllm.connector.leaseMode) -}}
{{- end -}}
{{- if ne .junctionRetention $.Values.vllm.connector.junctionRetention -}}
{{- fail (printf "vllm.arms: arm %q sets junctionRetention %t but the policy (which sets vllm.connector.junctionRetention=%t on its targets) manages it: set managedByPolicy: false on the arm" .name .junctionRetention $.Values.vllm.connector.junctionRetention) -}}
{{- end -}}
{{- $own := include "moonlease.retentionPieces" .retention -}}
{{- $policy := include "moonlease.retentionPieces" $.Values.vllm.connector.retention -}}
{{- if ne $own $policy -}}
{{- fail (printf "vllm.arms: arm %q sets retention %s but the policy (which sets vllm.connector.retention %s on its targets) manages it: set managedByPolicy: false on the arm" .name $own $policy) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and (eq (int $managed) 0) (not .Values.policy.targets) -}}
{{- fail "policy.enabled needs at least one target: enable vllm (with an arm managed by the policy), list policy.targets, or set policy.enabled=false" -}}
{{- end -}}
{{- if and (not $m.master.enabled) (not .Values.policy.masterWorkload) -}}
{{- fail "policy.masterWorkload is required when mooncake.master.enabled is false: a policy manages a master Deployment in its own namespace (or set policy.enabled=false)" -}}
{{- end -}}
{{- if not (has "master" .Values.policy.rollout.stages) -}}
{{- fail "policy.rollout.stages must include master" -}}
{{- end -}}
{{- if gt (int $managed) 0 -}}
{{- range $stage := list "prefill" "decode" -}}
{{- if not (has $stage $.Values.policy.rollout.stages) -}}
{{- fail (printf "policy.rollout.stages must include %s: the chart's %s Deployments are targets of the policy" $stage $stage) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $ab := .Values.policy.abTest -}}
{{- if $ab.enabled -}}
{{- if not .Values.vllm.enabled -}}
{{- fail "policy.abTest compares two of the chart's vllm.arms: set vllm.enabled=true with two arms, or policy.abTest.enabled=false" -}}
{{- end -}}
{{- $url := dig "analysis" "prometheus" "url" "" $ab -}}
{{- if and $url .Values.operator.enabled -}}
{{- $allowed := false -}}
{{- range .Values.operator.prometheusUrlAllowlist -}}
{{- if hasPrefix (trimSuffix "/" .) $url -}}{{- $allowed = true -}}{{- end -}}
{{- end -}}
{{- if not $allowed -}}
{{- fail (printf "policy.abTest.analysis.prometheus.url %s must be allowed by operator.prometheusUrlAllowlist, or the operator refuses the policy (PrometheusUrlNotAllowed)" $url) -}}
{{- end -}}
{{- end -}}
{{- if eq $ab.controlArm $ab.treatmentArm -}}
{{- fail (printf "policy.abTest: controlArm and treatmentArm are both %q: name two different arms of vllm.arms" $ab.controlArm) -}}
{{- end -}}
{{- $names := list -}}
{{- range $arms -}}
{{- $names = append $names .name -}}
{{- end -}}
{{- range $key, $wanted := dict "controlArm" $ab.controlArm "treatmentArm" $ab.treatmentArm -}}
{{- $found := false -}}
{{- range $arms -}}
{{- if eq .name $wanted -}}
{{- $found = true -}}
{{- if not .managed -}}
{{- fail (printf "policy.abTest.%s: arm %q sets managedByPolicy: false, but both A/B arms must be targets of the policy (the treatment gets its settings first, the control is held): remove managedByPolicy (and any leaseMode/junctionRetention of its own) from the arm" $key $wanted) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if not $found -}}
{{- fail (printf "policy.abTest.%s: vllm.arms has no arm named %q (arms: %s); add it, e.g. vllm.arms: [{name: control}, {name: treatment}]" $key $wanted (ternary "none" (join ", " (compact $names)) (empty (compact $names)))) -}}
{{- end -}}
{{- end -}}
{{- range $arms -}}
{{- if and .managed (not (has .name (list $ab.controlArm $ab.treatmentArm))) -}}
{{- fail (printf "vllm.arms: arm %q is managed by the policy but is neither policy.abTest.controlArm nor treatmentArm: an ABTest policy's targets must all be in one arm, so set managedByPolicy: false on it" .name) -}}
{{- end -}}
{{- end -}}
{{- if .Values.policy.targets -}}
{{- fail "policy.targets must be empty with policy.abTest: an ABTest policy's targets must all be in one of its two arms, which are the chart's" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.operator.enabled .Values.operator.watchNamespaces (not (has .Release.Namespace .Values.operator.watchNamespaces)) (not (has "*" .Values.operator.watchNamespaces)) -}}
{{- fail (printf "operator.watchNamespaces must include the release namespace %s, where the chart's policy lives (or set policy.enabled=false)" .Release.Namespace) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.policy.abTest.enabled (not .Values.policy.enabled) -}}
{{- fail "policy.abTest.enabled needs policy.enabled: the A/B test is a strategy of the chart's policy" -}}
{{- end -}}
{{- end -}}
