{{- define "servefleet.fullname" -}}
{{- if contains "servefleet" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-servefleet" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "servefleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "servefleet.engineImage" -}}
{{- printf "%s:%s" .Values.engineImage.repository (default .Chart.AppVersion .Values.engineImage.tag) -}}
{{- end -}}

{{- define "servefleet.labels" -}}
app.kubernetes.io/part-of: servefleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "servefleet.selector" -}}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "servefleet.redisURL" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s-redis.%s.svc:6379/0" (include "servefleet.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- .Values.redis.url -}}
{{- end -}}
{{- end -}}

{{- define "servefleet.gatewayURL" -}}
{{- printf "http://%s-gateway.%s.svc:%v" (include "servefleet.fullname" .) .Release.Namespace .Values.gateway.port -}}
{{- end -}}

{{- /*
The pod settings every component takes, from its values map (.values) and the chart's
(.root): pod metadata, then the scheduling and security fields of the pod spec, then the
container's. One definition, so the four components cannot drift apart.
*/ -}}
{{- define "servefleet.podMetadata" -}}
{{- $labels := fromYaml (include "servefleet.labels" .root) }}
{{- $_ := set $labels "app.kubernetes.io/component" .component }}
{{- /* merge keeps the first map's keys: podLabels never replace the chart's labels. */}}
{{- $metadata := dict "labels" (merge $labels (.values.podLabels | default dict)) }}
{{- with merge (.annotations | default dict) (.values.podAnnotations | default dict) }}
{{- $_ := set $metadata "annotations" . }}
{{- end }}
{{- toYaml $metadata }}
{{- end -}}

{{- define "servefleet.podScheduling" -}}
{{- $spec := dict }}
{{- with concat (.root.Values.imagePullSecrets | default list) (.values.imagePullSecrets | default list) }}
{{- $_ := set $spec "imagePullSecrets" . }}
{{- end }}
{{- range $key := list "priorityClassName" "nodeSelector" "tolerations" "affinity" "topologySpreadConstraints" }}
{{- with index $.values $key }}
{{- $_ := set $spec $key . }}
{{- end }}
{{- end }}
{{- with .values.podSecurityContext }}
{{- $_ := set $spec "securityContext" . }}
{{- end }}
{{- with $spec }}{{ toYaml . }}{{ end }}
{{- end -}}

{{- define "servefleet.containerSettings" -}}
{{- $container := dict "resources" (.resources | default dict) }}
{{- with .securityContext }}
{{- $_ := set $container "securityContext" . }}
{{- end }}
{{- toYaml $container }}
{{- end -}}

{{- /*
Without Redis every gateway replica enforces each tenant limit on its own, so N replicas
would allow N times every limit: refuse that rather than render it.
*/ -}}
{{- define "servefleet.checkGatewayReplicas" -}}
{{- if and (gt (int .Values.gateway.replicas) 1) (not (include "servefleet.redisURL" .)) -}}
{{- fail (printf "gateway.replicas=%v needs Redis (redis.enabled=true or redis.url): without it each gateway replica enforces every tenant limit on its own, %v times the configured limits in all" .Values.gateway.replicas .Values.gateway.replicas) -}}
{{- end -}}
{{- end -}}

{{- /* The gateway's base config file; its checksum rolls the gateway pods when it changes. */ -}}
{{- define "servefleet.gatewayConfig" -}}
{{- /* Deployments and tenants come from the route ConfigMaps the operator renders
(label servefleet.io/gateway-route=true). */ -}}
{{- $config := dict "host" "0.0.0.0" "port" .Values.gateway.port }}
{{- with include "servefleet.redisURL" . }}
{{- $_ := set $config "redis" (dict "url" . "gateway_replicas" $.Values.gateway.replicas) }}
{{- end }}
{{- toYaml (mergeOverwrite $config (deepCopy .Values.gateway.config)) }}
{{- end -}}
