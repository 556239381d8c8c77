{{/* Names, labels, images and the config each component reads. */}}

{{- define "rt.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rt.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "gateway") */}}
{{- define "rt.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "rt.serviceAccount" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rt.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "rt.image" -}}
{{- printf "%s:%s" .repo (default .root.Chart.AppVersion .root.Values.image.tag) -}}
{{- end -}}

{{- define "rt.gatewayHost" -}}
{{- printf "%s-gateway.%s.svc" (include "rt.fullname" .) .Release.Namespace -}}
{{- end -}}

{{/* Settings the chart owns: a user value for one of them stops the render with the value to change instead. */}}
{{- define "rt.owned" -}}
{{- $root := .root -}}
{{- range $key, $instead := .keys -}}
{{- if hasKey (index $root.Values.config $.section | default dict) $key -}}
{{- fail (printf "config.%s.%s is set by the chart: %s" $.section $key $instead) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The store cluster name (ON CLUSTER DDL); the in-cluster ClickHouse always has one. */}}
{{- define "rt.storeCluster" -}}
{{- if eq .Values.store.mode "clickhouse" -}}
{{- required "store.cluster names the ClickHouse cluster the chart creates (e.g. fleet)" .Values.store.cluster -}}
{{- else -}}
{{- .Values.store.cluster -}}
{{- end -}}
{{- end -}}

{{/* The gateway section: the user's settings plus the chart's (listen addresses, spool, cluster). */}}
{{- define "rt.gatewayConfig" -}}
{{- include "rt.owned" (dict "root" . "section" "gateway" "keys" (dict
    "otlp_listen" "use gateway.otlpPort"
    "metrics_listen" "use gateway.metricsPort"
    "spool" "use gateway.spool"
    "cluster" "use store.cluster"
    "store" "the DSN is a secret: use store.external or store.clickhouse")) -}}
{{- $owned := dict
    "otlp_listen" (printf "0.0.0.0:%v" .Values.gateway.otlpPort)
    "metrics_listen" (printf "0.0.0.0:%v" .Values.gateway.metricsPort)
    "spool" "/var/spool/ridethrough"
    "cluster" (include "rt.storeCluster" .) -}}
{{- with .Values.gateway.ingestTokens.existingSecret -}}
{{- if hasKey ($.Values.config.gateway | default dict) "tokens_file" -}}
{{- fail "config.gateway.tokens_file is set by the chart when gateway.ingestTokens.existingSecret is given" -}}
{{- end -}}
{{- $_ := set $owned "tokens_file" (printf "/etc/ridethrough/ingest/%s" $.Values.gateway.ingestTokens.key) -}}
{{- end -}}
{{- merge $owned (deepCopy (.Values.config.gateway | default dict)) | toYaml -}}
{{- end -}}

{{- define "rt.agentConfig" -}}
{{- include "rt.owned" (dict "root" . "section" "agent" "keys" (dict
    "gateway" "the chart points agents at its gateway Service"
    "prometheus_listen" "use agent.metricsPort"
    "sysfs_root" "the chart mounts the host's /sys read-only at /host/sys"
    "job_socket" "use agent.jobSocketDir")) -}}
{{- $owned := dict
    "gateway" (printf "%s:%v" (include "rt.gatewayHost" .) .Values.gateway.otlpPort)
    "prometheus_listen" (printf "0.0.0.0:%v" .Values.agent.metricsPort)
    "sysfs_root" "/host/sys"
    "job_socket" (printf "%s/job.sock" .Values.agent.jobSocketDir) -}}
{{- merge $owned (deepCopy (.Values.config.agent | default dict)) | toYaml -}}
{{- end -}}

{{- define "rt.controllerConfig" -}}
{{- include "rt.owned" (dict "root" . "section" "controller" "keys" (dict
    "metrics_listen" "use controller.metricsPort")) -}}
{{- $owned := dict "metrics_listen" (printf "0.0.0.0:%v" .Values.controller.metricsPort) -}}
{{- merge $owned (deepCopy (.Values.config.controller | default dict)) | toYaml -}}
{{- end -}}

{{- define "rt.pagerdutyConfig" -}}
{{- include "rt.owned" (dict "root" . "section" "pagerduty" "keys" (dict
    "outbox" "the chart keeps it under controller.state")) -}}
{{- $pd := .Values.config.pagerduty | default dict -}}
{{- range $route, $ref := ($pd.routing_keys | default dict) -}}
{{- if not (or (hasPrefix "env:" $ref) (hasPrefix "file:" $ref)) -}}
{{- fail (printf "config.pagerduty.routing_keys.%s must be env:VAR or file:PATH naming where the key is (put keys in the pagerduty.existingSecret Secret)" $route) -}}
{{- end -}}
{{- end -}}
{{- merge (dict "outbox" "/var/lib/ridethrough/pagerduty.sqlite3") (deepCopy $pd) | toYaml -}}
{{- end -}}

{{- define "rt.dashboardConfig" -}}
{{- include "rt.owned" (dict "root" . "section" "dashboard" "keys" (dict
    "listen" "use dashboard.port"
    "store" "the dashboard reads the gateway's store, whose DSN is a secret")) -}}
{{- $owned := dict "listen" (printf "0.0.0.0:%v" .Values.dashboard.port) -}}
{{- merge $owned (deepCopy (.Values.config.dashboard | default dict)) | toYaml -}}
{{- end -}}

{{/* The store DSN as container env, from a Secret only: (dict "root" $) */}}
{{- define "rt.storeEnv" -}}
{{- $root := .root -}}
{{- if eq $root.Values.store.mode "clickhouse" -}}
{{- $ch := $root.Values.store.clickhouse }}
- name: CLICKHOUSE_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ default (printf "%s-clickhouse" (include "rt.fullname" $root)) $ch.existingSecret }}
      key: password
- name: RIDETHROUGH_GATEWAY_STORE
  value: {{ printf "http://%s:$(CLICKHOUSE_PASSWORD)@clickhouse-%s.%s.svc:8123/%s" $ch.user (include "rt.fullname" $root) $root.Release.Namespace $ch.database | quote }}
{{- else }}
- name: RIDETHROUGH_GATEWAY_STORE
  valueFrom:
    secretKeyRef:
      name: {{ default (printf "%s-store" (include "rt.fullname" $root)) $root.Values.store.external.existingSecret }}
      key: {{ $root.Values.store.external.existingSecretKey }}
{{- end }}
{{- end -}}

{{- define "rt.restrictedContainer" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: [ALL]
{{- end -}}
