{{/* Ray pods: the head's and the worker groups' templates, built by one helper. */}}
{{- define "specray.workerGroup" -}}
{{- $root := .root }}
{{- $group := .group }}
- groupName: {{ $group.groupName }}
  replicas: {{ $group.replicas }}
  minReplicas: {{ $group.minReplicas }}
  maxReplicas: {{ $group.maxReplicas }}
  rayStartParams:
    {{- /* The custom resource marks the node type for placement (specray.cluster.placement);
           GPUs and CPUs bound how many workers a pod holds. KubeRay passes `resources` to a
           shell unquoted, so it is the JSON object as a quoted string: "{\"draft\":1000}". */}}
    {{- $fixed := dict "num-gpus" (toString $group.gpus) "resources" (printf "%q" (toJson (dict .resource $group.resourceUnits))) "metrics-export-port" (include "specray.rayMetricsPort" $root) }}
    {{- toYaml (merge $fixed (deepCopy ($group.rayStartParams | default dict))) | nindent 4 }}
  template:
    {{- $ports := list (dict "name" "metrics" "containerPort" (include "specray.rayMetricsPort" $root | int)) }}
    {{- include "specray.podTemplate" (dict "root" $root "group" $group "component" .component "container" "ray-worker" "ports" $ports "gpus" $group.gpus) | trim | nindent 4 }}
{{- end }}

{{/* A Ray pod template. Arguments: root, group (the head's or a worker group's values),
     component (head, draft, target: a label), container (the Ray container's name), ports
     (its container ports), gpus (nvidia.com/gpu of the Ray container; 0: none). Labels: the
     group's podLabels over the chart-wide ones, the chart's own (selectors use them) over
     both; KubeRay adds ray.io/node-type, ray.io/group, ray.io/cluster. KubeRay's own
     readiness and liveness probes stay (see README: why none on /health). */}}
{{- define "specray.podTemplate" -}}
{{- $root := .root }}
{{- $group := .group }}
{{- $chartLabels := include "specray.selectorLabels" $root | fromYaml }}
{{- $_ := set $chartLabels "app.kubernetes.io/component" .component }}
metadata:
  labels:
    {{- toYaml (merge $chartLabels (deepCopy ($group.podLabels | default dict)) (deepCopy ($root.Values.podLabels | default dict))) | nindent 4 }}
  {{- with $group.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with (include "specray.podSpecCommon" . | trim) }}
  {{- . | nindent 2 }}
  {{- end }}
  {{- with (include "specray.initContainers" . | trim) }}
  initContainers:
    {{- . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .container }}
      image: {{ include "specray.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      ports:
        {{- toYaml .ports | nindent 8 }}
      {{- with (include "specray.containerCommon" . | trim) }}
      {{- . | nindent 6 }}
      {{- end }}
  {{- with (include "specray.volumes" . | trim) }}
  volumes:
    {{- . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* Pod-level fields: a group's scalar replaces the chart-wide one, its lists follow them. */}}
{{- define "specray.podSpecCommon" -}}
{{- $values := .root.Values }}
{{- $group := .group }}
{{- with $values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- range $field := list "serviceAccountName" "priorityClassName" "runtimeClassName" "schedulerName" }}
{{- with (index $group $field | default (index $values $field)) }}
{{ $field }}: {{ . }}
{{- end }}
{{- end }}
{{- with $values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $group.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $group.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $group.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with concat ($values.topologySpreadConstraints | default list) ($group.topologySpreadConstraints | default list) }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Init containers: the model downloads (models.download), then the extra ones (chart-wide,
     then the group's). KubeRay appends its own (workers wait for the GCS) after these. */}}
{{- define "specray.initContainers" -}}
{{- $values := .root.Values }}
{{- $download := $values.models.download }}
{{- if $download.enabled }}
{{- if not $download.sources }}
{{- fail "models.download.enabled needs models.download.sources, e.g. {target: s3://bucket/model}" }}
{{- end }}
{{- range $name, $url := $download.sources }}
{{- $dest := printf "%s/%s" (trimSuffix "/" $values.models.mountPath) $name }}
{{- $scheme := regexFind "^[a-z0-9]+" $url }}
- name: download-{{ $name }}
  {{- if eq $scheme "s3" }}
  image: {{ $download.images.s3 }}
  command: [aws, s3, sync, --only-show-errors, {{ $url | quote }}, {{ $dest | quote }}]
  {{- else if eq $scheme "gs" }}
  image: {{ $download.images.gs }}
  command:
    - sh
    - -c
    - mkdir -p "$2" && exec gcloud storage rsync --recursive "$1" "$2"
    - download
    - {{ $url | quote }}
    - {{ $dest | quote }}
  {{- else }}
  {{- /* hf://org/name[@revision]: huggingface_hub comes with specray[server] (transformers) */}}
  image: {{ $download.images.hf | default (include "specray.image" $.root) }}
  command:
    - python
    - -c
    - |
      import sys
      from huggingface_hub import snapshot_download
      repo, _, revision = sys.argv[1].partition("@")
      snapshot_download(repo, revision=revision or None, local_dir=sys.argv[2])
    - {{ trimPrefix "hf://" $url | quote }}
    - {{ $dest | quote }}
  {{- end }}
  imagePullPolicy: {{ $values.image.pullPolicy }}
  {{- with $download.credentialsSecret }}
  envFrom:
    - secretRef: {name: {{ . }}}
  {{- end }}
  volumeMounts:
    - {name: models, mountPath: {{ $values.models.mountPath }}}
  {{- with $download.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $values.containerSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}
{{- with concat ($values.initContainers | default list) (.group.initContainers | default list) }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Ray container fields: env, mounts, resources (+ its GPUs), security context. */}}
{{- define "specray.containerCommon" -}}
{{- with (include "specray.env" . | trim) }}
env:
  {{- . | nindent 2 }}
{{- end }}
{{- with (include "specray.volumeMounts" . | trim) }}
volumeMounts:
  {{- . | nindent 2 }}
{{- end }}
{{- $resources := deepCopy (.group.resources | default dict) }}
{{- if .gpus }}
{{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" .gpus) ($resources.limits | default dict)) }}
{{- end }}
{{- with $resources }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.containerSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
