{{/* Names: KubeRay appends 6 characters to a RayService name for its RayCluster and
     rejects RayService names over 47 characters. */}}
{{- define "specray.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 47 | trimSuffix "-" }}
{{- end }}

{{- define "specray.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specray.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specray.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specray.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "specray.labels" -}}
helm.sh/chart: {{ include "specray.chart" . }}
{{ include "specray.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "specray.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* "true" when the app has a draft model: AppArgs maps "none" and "" to none, and a
     missing key to its default ("default"). */}}
{{- define "specray.draftEnabled" -}}
{{- $draft := ternary (toString .Values.app.draft) "default" (hasKey .Values.app "draft") }}
{{- if not (has (lower $draft) (list "none" "")) }}true{{ end }}
{{- end }}

{{/* "true" when the app deploys a draft pool on draft nodes (AppArgs.draft_pool): a draft
     that is not colocated with its target group. A colocated draft takes no draft settings. */}}
{{- define "specray.draftPool" -}}
{{- if and (include "specray.draftEnabled" .) (ne (toString .Values.app.draft_placement) "colocated") }}true{{ end }}
{{- end }}

{{/* "true" when the draft pool autoscales (AppArgs.autoscaled). */}}
{{- define "specray.autoscaled" -}}
{{- if and (include "specray.draftPool" .) (not (kindIs "invalid" .Values.app.max_draft_workers)) }}true{{ end }}
{{- end }}

{{- define "specray.tlsDir" -}}/etc/specray/tls{{- end }}
{{- define "specray.authEnv" -}}SPECRAY_AUTH_TOKEN{{- end }}

{{/* The Serve deploy config (ServeDeploySchema), built as data and dumped, as
     specray.serve.launch.deploy_config builds it. */}}
{{- define "specray.serveConfig" -}}
{{- $args := dict }}
{{- range $key, $value := .Values.app }}
{{- if not (kindIs "invalid" $value) }}
{{- $_ := set $args $key $value }}
{{- end }}
{{- end }}
{{- if not (hasKey .Values.app "grpc_port") }}
{{- /* Helm deletes a key set to null: render the null, "no gRPC API", explicitly. */}}
{{- $_ := set $args "grpc_port" nil }}
{{- end }}
{{- if and (include "specray.draftEnabled" .) (not (include "specray.draftPool" .)) }}
{{- /* A colocated draft has no pool: the pool's sizes (the values' defaults) do not apply. */}}
{{- $_ := unset $args "num_draft_workers" }}
{{- $_ := unset $args "max_draft_workers" }}
{{- end }}
{{- $_ := set $args "ingress_on_head" true }}
{{- if .Values.auth.existingSecret }}
{{- $_ := set $args "auth_token_env" (include "specray.authEnv" .) }}
{{- end }}
{{- if .Values.tls.existingSecret }}
{{- $_ := set $args "tls_cert" (printf "%s/tls.crt" (include "specray.tlsDir" .)) }}
{{- $_ := set $args "tls_key" (printf "%s/tls.key" (include "specray.tlsDir" .)) }}
{{- if .Values.tls.clientCA }}
{{- $_ := set $args "tls_client_ca" (printf "%s/ca.crt" (include "specray.tlsDir" .)) }}
{{- end }}
{{- end }}
{{- $app := dict "name" "specray" "route_prefix" "/" "import_path" "specray.serve:build_app" }}
{{- if include "specray.autoscaled" . }}
{{- $_ := set $args "autoscaling" "application" }}
{{- $groups := .Values.app.num_target_groups | default 1 }}
{{- $kwargs := dict "min_drafts_per_group" (.Values.app.num_draft_workers | default 1) "max_drafts_per_group" .Values.app.max_draft_workers "scale_target_groups" false "min_target_groups" $groups "max_target_groups" $groups }}
{{- $_ := set $app "autoscaling_policy" (dict "policy_function" "specray.cluster.autoscaling:ApplicationPolicy" "policy_kwargs" $kwargs) }}
{{- end }}
{{- $_ := set $app "args" $args }}
{{- $config := dict "proxy_location" "HeadOnly" "http_options" (dict "host" "0.0.0.0" "port" 8000) "applications" (list $app) }}
{{- toYaml $config }}
{{- end }}

{{- define "specray.rayMetricsPort" -}}8080{{- end }}

{{/* Env, volumes and mounts of a Ray container and its pod. Arguments: root, group (the
     head's or a worker group's values): the chart-wide lists first, then the group's. */}}
{{- define "specray.env" -}}
{{- $values := .root.Values }}
{{- if $values.auth.existingSecret }}
- name: {{ include "specray.authEnv" .root }}
  valueFrom:
    secretKeyRef:
      name: {{ $values.auth.existingSecret }}
      key: {{ $values.auth.secretKey }}
{{- end }}
{{- if $values.rayServe.haproxy }}
{{- /* specray.cluster.serve_env.SERVE_ENV; a test keeps the two the same */}}
- {name: RAY_SERVE_ENABLE_HA_PROXY, value: "1"}
- {name: RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD, value: "0"}
- {name: RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE, value: "1000"}
{{- end }}
{{- with concat ($values.extraEnv | default list) (.group.extraEnv | default list) }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "specray.modelsMounted" -}}
{{- if or .Values.models.claimName .Values.models.download.enabled }}true{{ end }}
{{- end }}

{{- define "specray.volumeMounts" -}}
{{- $values := .root.Values }}
{{- if include "specray.modelsMounted" .root }}
- name: models
  mountPath: {{ $values.models.mountPath }}
  readOnly: true
{{- end }}
{{- if $values.tls.existingSecret }}
- name: tls
  mountPath: {{ include "specray.tlsDir" .root }}
  readOnly: true
{{- end }}
{{- if .group.shmSize }}
- {name: dshm, mountPath: /dev/shm}
{{- end }}
{{- with concat ($values.extraVolumeMounts | default list) (.group.extraVolumeMounts | default list) }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "specray.volumes" -}}
{{- $values := .root.Values }}
{{- $download := $values.models.download }}
{{- if and $download.enabled $values.models.claimName }}
{{- fail "models.download.enabled copies the models into an emptyDir at models.mountPath: set models.claimName to \"\" (the PVC is read-only)" }}
{{- end }}
{{- if $values.models.claimName }}
- name: models
  persistentVolumeClaim:
    claimName: {{ $values.models.claimName }}
    readOnly: true
{{- else if $download.enabled }}
- name: models
  emptyDir: {{ if $download.sizeLimit }}{sizeLimit: {{ $download.sizeLimit }}}{{ else }}{}{{ end }}
{{- end }}
{{- if $values.tls.existingSecret }}
- name: tls
  secret:
    secretName: {{ $values.tls.existingSecret }}
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      {{- if $values.tls.clientCA }}
      - {key: ca.crt, path: ca.crt}
      {{- end }}
{{- end }}
{{- with .group.shmSize }}
- name: dshm
  emptyDir: {medium: Memory, sizeLimit: {{ . }}}
{{- end }}
{{- with concat ($values.extraVolumes | default list) (.group.extraVolumes | default list) }}
{{ toYaml . }}
{{- end }}
{{- end }}
