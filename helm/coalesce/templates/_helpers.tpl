{{/* Names, labels and the pieces every Coalesce pod shares. */}}

{{- define "coalesce.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "coalesce.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "coalesce.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "coalesce.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Common labels; call with (dict "ctx" $ "component" "worker"). */}}
{{- define "coalesce.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
{{ include "coalesce.selectorLabels" . }}
{{- end -}}

{{- define "coalesce.selectorLabels" -}}
app.kubernetes.io/name: {{ include "coalesce.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "coalesce.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "coalesce.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "coalesce.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "coalesce.workerService" -}}
{{- printf "%s-worker" (include "coalesce.fullname" .) -}}
{{- end -}}

{{- define "coalesce.redisService" -}}
{{- printf "%s-redis" (include "coalesce.fullname" .) -}}
{{- end -}}

{{/* Non-root, read-only root filesystem, no capabilities, no privilege escalation. */}}
{{- define "coalesce.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* The store URL: plain for the bundled Redis without a password; from a Secret otherwise. */}}
{{- define "coalesce.storeEnv" -}}
{{- if .Values.redis.enabled }}
{{- if .Values.redis.auth.existingSecret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.auth.existingSecret }}
      key: password
- name: COALESCE_STORE
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:%d/0" (include "coalesce.redisService" .) (int .Values.redis.port) | quote }}
{{- end }}
{{- else }}
- name: COALESCE_STORE
  valueFrom:
    secretKeyRef:
      name: {{ required "externalRedis.existingSecret is required when redis.enabled is false" .Values.externalRedis.existingSecret }}
      key: {{ .Values.externalRedis.key }}
{{- end }}
{{- end -}}

{{- define "coalesce.otelEnv" -}}
{{- $endpoint := .Values.otel.endpoint -}}
{{- if .Values.jaeger.enabled -}}
{{- $endpoint = printf "http://%s-jaeger:4317" (include "coalesce.fullname" .) -}}
{{- end -}}
{{- if $endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $endpoint | quote }}
{{- end }}
{{- end -}}

{{/* Volumes and mounts every Coalesce container has: config, /tmp, internal mTLS. */}}
{{- define "coalesce.commonVolumes" -}}
- name: config
  configMap:
    name: {{ include "coalesce.fullname" . }}-config
- name: tmp
  emptyDir: {}
{{- if .Values.internalTls.enabled }}
- name: internal-tls
  secret:
    secretName: {{ required "internalTls.existingSecret is required when internalTls.enabled" .Values.internalTls.existingSecret }}
{{- end }}
{{- end -}}

{{- define "coalesce.commonMounts" -}}
- name: config
  mountPath: /etc/coalesce/config.yaml
  subPath: config.yaml
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if .Values.internalTls.enabled }}
- name: internal-tls
  mountPath: /etc/coalesce/internal-tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* Native gRPC probes need a plaintext port; with TLS on that port they fall back to a TCP connect. */}}
{{- define "coalesce.probe" -}}
{{- if .tls }}
tcpSocket:
  port: {{ .port }}
{{- else }}
grpc:
  port: {{ .port }}
{{- end }}
{{- end -}}
