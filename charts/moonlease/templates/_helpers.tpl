{{/*
Names, labels and the values-derived settings every template shares. Each setting is decided
here once (the master address, the store pool's memory, the connector's kv-transfer-config, the
arms) and read by the templates and the policy, so the workloads and the policy cannot disagree.
*/}}

{{- define "moonlease.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "moonlease.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "moonlease.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object; pass (dict "ctx" $ "component" "...") */}}
{{- define "moonlease.labels" -}}
helm.sh/chart: {{ include "moonlease.chart" .ctx }}
{{ include "moonlease.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: moonlease
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels; pass (dict "ctx" $ "component" "..." ["arm" "..."]) */}}
{{- define "moonlease.selectorLabels" -}}
app.kubernetes.io/name: {{ include "moonlease.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- if .arm }}
moonlease.io/arm: {{ .arm }}
{{- end }}
{{- end -}}

{{- define "moonlease.operatorName" -}}
{{- printf "%s-operator" (include "moonlease.fullname" .) -}}
{{- end -}}

{{- define "moonlease.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- default (include "moonlease.operatorName" .) .Values.operator.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.operator.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "moonlease.masterName" -}}
{{- printf "%s-mooncake-master" (include "moonlease.fullname" .) -}}
{{- end -}}

{{- define "moonlease.storePoolName" -}}
{{- printf "%s-store-pool" (include "moonlease.fullname" .) -}}
{{- end -}}

{{- define "moonlease.storeConfigName" -}}
{{- printf "%s-store-config" (include "moonlease.fullname" .) -}}
{{- end -}}

{{- define "moonlease.fleetOrderName" -}}
{{- printf "%s-fleet-order" (include "moonlease.fullname" .) -}}
{{- end -}}

{{/* The fleet order service's URL (its Service in the release namespace), which engines with
retention evict report to. */}}
{{- define "moonlease.fleetOrderUrl" -}}
{{- printf "http://%s.%s.svc:%d" (include "moonlease.fleetOrderName" .) .Release.Namespace (int .Values.fleetOrder.port) -}}
{{- end -}}

{{/* The fleet order service's image: fleetOrder.image when it names a repository, else the
connector image the engines run (vllm.image), which holds the service. */}}
{{- define "moonlease.fleetOrderImage" -}}
{{- if .Values.fleetOrder.image.repository -}}
{{- .Values.fleetOrder.image | toJson -}}
{{- else -}}
{{- .Values.vllm.image | toJson -}}
{{- end -}}
{{- end -}}

{{- define "moonlease.policyName" -}}
{{- default (include "moonlease.fullname" .) .Values.policy.name -}}
{{- end -}}

{{/* host:port of the Mooncake master: the chart's Service, or the external address. */}}
{{- define "moonlease.masterAddress" -}}
{{- if .Values.mooncake.master.enabled -}}
{{- printf "%s.%s.svc:%d" (include "moonlease.masterName" .) .Release.Namespace (int .Values.mooncake.master.rpcPort) -}}
{{- else -}}
{{- .Values.mooncake.master.externalAddress -}}
{{- end -}}
{{- end -}}

{{/* A value as a gflags flag value: booleans true/false, whole numbers without exponent. */}}
{{- define "moonlease.flagValue" -}}
{{- if kindIs "bool" . -}}
{{- ternary "true" "false" . -}}
{{- else if and (kindIs "float64" .) (eq . (floor .)) -}}
{{- int64 . -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/* The store pool pod's memory, MiB: segment + transfer buffer + the process itself. */}}
{{- define "moonlease.storePoolMemoryMiB" -}}
{{- $p := .Values.mooncake.storePool -}}
{{- add (int64 $p.globalSegmentSizeMiB) (int64 $p.localBufferSizeMiB) (int64 $p.memoryOverheadMiB) -}}
{{- end -}}

{{/*
The vLLM arms as JSON {"arms": [{name, suffix, leaseMode, junctionRetention, retention, managed,
prefillReplicas, decodeReplicas}]}: one unnamed arm when vllm.arms is empty.
*/}}
{{- define "moonlease.arms" -}}
{{- $v := .Values.vllm -}}
{{- $arms := list -}}
{{- if not $v.arms -}}
{{- $arms = append $arms (dict "name" "" "suffix" "" "leaseMode" $v.connector.leaseMode "junctionRetention" $v.connector.junctionRetention "retention" ($v.connector.retention | default dict) "managed" true "prefillReplicas" (int64 $v.prefill.replicas) "decodeReplicas" (int64 $v.decode.replicas) "podAnnotations" dict) -}}
{{- else -}}
{{- range $v.arms -}}
{{- $managed := ternary .managedByPolicy true (hasKey . "managedByPolicy") -}}
{{- $prefill := ternary .prefillReplicas $v.prefill.replicas (hasKey . "prefillReplicas") -}}
{{- $decode := ternary .decodeReplicas $v.decode.replicas (hasKey . "decodeReplicas") -}}
{{- $junction := ternary .junctionRetention $v.connector.junctionRetention (hasKey . "junctionRetention") -}}
{{- $retention := ternary .retention ($v.connector.retention | default dict) (hasKey . "retention") -}}
{{- $arms = append $arms (dict "name" .name "suffix" (printf "-%s" .name) "leaseMode" (default $v.connector.leaseMode .leaseMode) "junctionRetention" $junction "retention" $retention "managed" $managed "prefillReplicas" (int64 $prefill) "decodeReplicas" (int64 $decode) "podAnnotations" (.podAnnotations | default dict)) -}}
{{- end -}}
{{- end -}}
{{- dict "arms" $arms | toJson -}}
{{- end -}}

{{/* Retention pieces as a comparable string ("skip=false,pin=true,..."); pass a dict. */}}
{{- define "moonlease.retentionPieces" -}}
{{- $r := . | default dict -}}
{{- printf "skip=%t,pin=%t,retry=%t,evict=%t" (eq $r.skip true) (eq $r.pin true) (eq $r.retry true) (eq $r.evict true) -}}
{{- end -}}

{{/* The connector's settings file and kv-transfer-config for one role of one arm, as JSON
{"file": {...}, "kvTransferConfig": {...}}; pass (dict "ctx" $ "role" "prefill" "arm" $arm).
The workload is rendered already adopted, as the operator would leave it: its lease mode lives
in the settings file (a ConfigMap per workload, mounted at /etc/moonlease/connector), which the
running connector re-reads when the operator changes it; the kv-transfer-config only names it. */}}
{{- define "moonlease.connectorSettings" -}}
{{- $v := .ctx.Values.vllm -}}
{{- /* leaseMode is the connector's mooncake_lease_mode, same spelling (one vocabulary). */ -}}
{{- $file := dict "mooncake_lease_mode" .arm.leaseMode "mooncake_junction_retention" .arm.junctionRetention -}}
{{- /* Every retention switch, off included, as the operator renders them (a switch left out
would fall back to the engine's start-up settings); the watermark only with evict on. */ -}}
{{- $retention := .arm.retention | default dict -}}
{{- $_ := set $file "mooncake_retention_pin" (eq $retention.pin true) -}}
{{- $_ := set $file "mooncake_retention_skip" (eq $retention.skip true) -}}
{{- $_ := set $file "mooncake_retention_retry" (eq $retention.retry true) -}}
{{- $_ := set $file "mooncake_retention_evict" (eq $retention.evict true) -}}
{{- if $retention.evict -}}
{{- $_ := set $file "mooncake_retention_evict_watermark" (float64 (index .ctx.Values.mooncake.master.settings "eviction_high_watermark_ratio")) -}}
{{- end -}}
{{- $extra := mergeOverwrite (deepCopy ($v.connector.extraConfig | default dict)) (dict "mooncake_settings_file" "/etc/moonlease/connector/connector-settings.json") -}}
{{- if and $retention.evict (not (hasKey $extra "mooncake_master_metrics_url")) -}}
{{- $host := regexReplaceAll ":[0-9]+$" (include "moonlease.masterAddress" .ctx) "" -}}
{{- $_ := set $extra "mooncake_master_metrics_url" (printf "http://%s:%d/metrics" $host (int .ctx.Values.mooncake.master.metricsPort)) -}}
{{- end -}}
{{- /* The fleet order service (fleetOrder.enabled): evict orders the keys by every engine's
saves and loads, not this engine's alone. Every engine gets it, evict on or not: a policy turns
evict on live (the settings file), without a restart that could bring the URL. */ -}}
{{- if and .ctx.Values.fleetOrder.enabled (not (hasKey $extra "mooncake_fleet_order_url")) -}}
{{- $_ := set $extra "mooncake_fleet_order_url" (include "moonlease.fleetOrderUrl" .ctx) -}}
{{- end -}}
{{- $kv := dict "kv_connector" "MooncakeStoreConnector" "kv_connector_module_path" "moonlease_connector" "kv_role" (index $v .role).kvRole "kv_load_failure_policy" ($v.connector.loadFailurePolicy | default "recompute") "kv_connector_extra_config" $extra -}}
{{- dict "file" $file "kvTransferConfig" $kv | toJson -}}
{{- end -}}

{{/* The engines' Mooncake store config (MOONCAKE_CONFIG_PATH), as JSON. */}}
{{- define "moonlease.storeConfig" -}}
{{- $m := .Values.mooncake -}}
{{- dict "metadata_server" "P2PHANDSHAKE" "master_server_address" (include "moonlease.masterAddress" .) "protocol" $m.protocol "device_name" $m.rdmaDevices "mode" "standalone-store" "global_segment_size" 0 "local_buffer_size" (printf "%dMB" (int64 .Values.vllm.store.localBufferSizeMiB)) | toPrettyJson -}}
{{- end -}}

{{/* Pod security context of every pod; pass the uid. */}}
{{- define "moonlease.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ . }}
runAsGroup: {{ . }}
fsGroup: {{ . }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Container security context; pass (dict "readOnly" bool "ipcLock" bool). IPC_LOCK: RDMA
registers (pins) memory. */}}
{{- define "moonlease.containerSecurityContext" -}}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: {{ .readOnly }}
capabilities:
  drop: ["ALL"]
  {{- if .ipcLock }}
  add: ["IPC_LOCK"]
  {{- end }}
{{- end -}}

{{/*
Labels of pod templates; pass (dict "ctx" $ "component" "..." ["arm" "..."]). The selector labels
and the release's constant ones, never the chart or app version: a `helm upgrade` that changes only
the chart version must leave every pod template as it is (a new master pod empties the store).
*/}}
{{- define "moonlease.podLabels" -}}
{{ include "moonlease.selectorLabels" . }}
app.kubernetes.io/part-of: moonlease
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* An image reference; pass (dict "ctx" $ "image" $values.image): `global.imageRegistry` (if
set) before the repository, then `@digest` when a digest is set (it overrides the tag), else `:tag`. */}}
{{- define "moonlease.image" -}}
{{- $registry := (.ctx.Values.global).imageRegistry | default "" | trimSuffix "/" -}}
{{- $repository := ternary (printf "%s/%s" $registry .image.repository) .image.repository (ne $registry "") -}}
{{- if .image.digest -}}
{{- printf "%s@%s" $repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repository .image.tag -}}
{{- end -}}
{{- end -}}

{{/* Annotations for annotation-based Prometheus scraping; pass the metrics port. */}}
{{- define "moonlease.scrapeAnnotations" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ . | quote }}
prometheus.io/path: /metrics
{{- end -}}

{{/*
Where a component's pods may run; pass (dict "ctx" $ "values" $componentValues "selector"
(dict "ctx" $ "component" "..." ["arm" "..."])): priorityClassName, nodeSelector, tolerations,
affinity and topologySpreadConstraints (a constraint without a labelSelector gets the
component's selector labels, so it spreads this component's pods and nothing else).
*/}}
{{- define "moonlease.podScheduling" -}}
{{- $c := .values -}}
{{- with $c.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $c.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if $c.topologySpreadConstraints }}
{{- $selector := dict "matchLabels" (include "moonlease.selectorLabels" .selector | fromYaml) }}
{{- $constraints := list }}
{{- range $c.topologySpreadConstraints }}
{{- if hasKey . "labelSelector" }}
{{- $constraints = append $constraints . }}
{{- else }}
{{- $constraints = append $constraints (merge (dict "labelSelector" (deepCopy $selector)) .) }}
{{- end }}
{{- end }}
topologySpreadConstraints:
  {{- toYaml $constraints | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
The namespaces the operator watches, as JSON {"all": bool, "names": [...]}: the release namespace
unless operator.watchNamespaces names others, every namespace only for ["*"] (the one case that
needs cluster-wide rules on Deployments and ConfigMaps).
*/}}
{{- define "moonlease.watchedNamespaces" -}}
{{- $asked := .Values.operator.watchNamespaces | default list -}}
{{- if has "*" $asked -}}
{{- dict "all" true "names" list | toJson -}}
{{- else -}}
{{- dict "all" false "names" ($asked | default (list .Release.Namespace)) | toJson -}}
{{- end -}}
{{- end -}}

{{/*
An alert's labels (its severity from monitoring.prometheusRule.severities, plus any given) and the
start of its annotations: runbook_url, the alert's section under "Runbooks" in the chart README
(monitoring.prometheusRule.runbookBaseUrl + "#" + the alert's name in lower case, GitHub's anchor
for a heading). The caller continues the annotations. Input: dict "r" (the prometheusRule values),
"alert", optional "labels".
*/}}
{{- define "moonlease.alertMeta" -}}
labels:
  severity: {{ index .r.severities .alert | default "warning" }}
  {{- with .labels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
annotations:
  runbook_url: {{ printf "%s#%s" (.r.runbookBaseUrl | default "README.md") (lower .alert) | quote }}
{{- end -}}

{{/*
The store usage above which MoonleaseStoreNearlyFull fires: monitoring.prometheusRule.storeFullRatio,
or halfway between the master's eviction watermark (Mooncake's default 0.9) and a full store.
*/}}
{{- define "moonlease.storeFullRatio" -}}
{{- $given := .Values.monitoring.prometheusRule.storeFullRatio -}}
{{- if kindIs "invalid" $given -}}
{{- $watermark := index .Values.mooncake.master.settings "eviction_high_watermark_ratio" | default 0.9 | float64 -}}
{{- printf "%g" (addf $watermark (divf (subf 1.0 $watermark) 2.0)) -}}
{{- else -}}
{{- printf "%g" (float64 $given) -}}
{{- end -}}
{{- end -}}
