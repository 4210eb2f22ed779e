{{/* Ray pod pieces: the worker groups and what every Ray pod and container shares. */}}
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
    {{- $fixed := dict "num-gpus" (toString $group.gpus) "resources" (printf "%q" (toJson (dict .resource $group.resourceUnits))) }}
    {{- toYaml (merge $fixed (deepCopy ($group.rayStartParams | default dict)) (dict "metrics-export-port" "8080")) | nindent 4 }}
  template:
    metadata:
      labels:
        {{- include "specray.selectorLabels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ .component }}
      {{- with $group.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- with (include "specray.podSpecCommon" (dict "root" $root "group" $group) | trim) }}
      {{- . | nindent 6 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "specray.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          ports:
            - {name: metrics, containerPort: 8080}
          {{- with (include "specray.containerCommon" (dict "root" $root "group" $group "gpus" $group.gpus) | trim) }}
          {{- . | nindent 10 }}
          {{- end }}
      {{- $volumes := include "specray.volumes" $root | trim }}
      {{- if or $volumes $group.shmSize }}
      volumes:
        {{- with $volumes }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with $group.shmSize }}
        - name: dshm
          emptyDir: {medium: Memory, sizeLimit: {{ . }}}
        {{- end }}
      {{- end }}
{{- end }}

{{/* Pod-level fields every group shares: pull secrets, security context, scheduling. */}}
{{- define "specray.podSpecCommon" -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Container fields every Ray container shares: env, mounts, resources (+ its GPUs). */}}
{{- define "specray.containerCommon" -}}
{{- $root := .root }}
{{- with (include "specray.env" $root | trim) }}
env:
  {{- . | nindent 2 }}
{{- end }}
{{- $mounts := include "specray.volumeMounts" $root | trim }}
{{- if or $mounts .group.shmSize }}
volumeMounts:
  {{- with $mounts }}
  {{- . | nindent 2 }}
  {{- end }}
  {{- if .group.shmSize }}
  - {name: dshm, mountPath: /dev/shm}
  {{- end }}
{{- end }}
{{- $resources := deepCopy (.group.resources | default dict) }}
{{- if .gpus }}
{{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" .gpus) ($resources.limits | default dict)) }}
{{- end }}
{{- with $resources }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.containerSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
