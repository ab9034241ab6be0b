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

{{- /*
The namespaces whose LLMDeployments the operator reconciles, the autoscaler scales and the
gateway routes, as a YAML list; the chart's Roles are bound in each. Empty (every namespace)
only with rbac.clusterWide; otherwise operator.watchNamespaces, else the release namespace.
*/ -}}
{{- define "servefleet.watchNamespaces" -}}
{{- if .Values.operator.watchNamespaces -}}
{{- toYaml .Values.operator.watchNamespaces -}}
{{- else if .Values.rbac.clusterWide -}}
[]
{{- else -}}
{{- toYaml (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}

{{- /*
A random value kept across upgrades: the one already in the Secret when there is one
(helm's lookup; `helm template` has no cluster, so it renders a fresh one), base64.
Arguments: root, name (the Secret), key.
*/ -}}
{{- define "servefleet.generatedValue" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name -}}
{{- $data := (and $existing $existing.data) | default dict -}}
{{- if hasKey $data .key -}}
{{- index $data .key -}}
{{- else -}}
{{- randAlphaNum 48 | b64enc -}}
{{- end -}}
{{- end -}}

{{- /* The Secret holding Redis' password (key `password`), or "" when there is none. */ -}}
{{- define "servefleet.redisPasswordSecret" -}}
{{- if .Values.redis.enabled -}}
{{- printf "%s-redis" (include "servefleet.fullname" .) -}}
{{- else -}}
{{- .Values.redis.passwordSecret -}}
{{- end -}}
{{- end -}}

{{- /* Where the chart's generated keys are mounted in its pods. */ -}}
{{- define "servefleet.internalKeyFile" -}}/etc/servefleet/internal/internal-api-key{{- end -}}
{{- define "servefleet.routeKeyFile" -}}/etc/servefleet/route-signing/route-signing-key{{- end -}}
{{- define "servefleet.redisPasswordFile" -}}/etc/servefleet/redis/password{{- end -}}

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

{{- /*
The Batch API: one store (a folder, on a PVC or an emptyDir, or a bucket). Several gateway
replicas only over a bucket: they all see every batch there, and a Redis lease per batch
(gateway/batch_lease.py; several replicas need Redis anyway) lets one of them run it. A folder
is one pod's, so its batches would be invisible to the other replicas.
*/ -}}
{{- define "servefleet.checkGatewayBatch" -}}
{{- $batch := .Values.gateway.batch -}}
{{- if $batch.enabled -}}
{{- if and $batch.s3.bucket $batch.persistence.enabled -}}
{{- fail "gateway.batch: set s3.bucket or persistence.enabled, not both (one store)" -}}
{{- end -}}
{{- if and (gt (int .Values.gateway.replicas) 1) (not $batch.s3.bucket) -}}
{{- fail (printf "gateway.batch.enabled with gateway.replicas=%v and a folder store: each replica would see only its own batches; set gateway.batch.s3.bucket (the replicas share it) or serve the Batch API from one replica" .Values.gateway.replicas) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "servefleet.batchDir" -}}/var/lib/servefleet/batches{{- end -}}

{{- /* The gateway's base config file; its checksum rolls the gateway pods when it changes. */ -}}
{{- define "servefleet.gatewayConfig" -}}
{{- /* Deployments and tenants come from the route ConfigMaps the operator renders
(label servefleet.io/gateway-route=true). */ -}}
{{- $config := dict "host" "0.0.0.0" "port" .Values.gateway.port }}
{{- with include "servefleet.redisURL" . }}
{{- $redis := dict "url" . "gateway_replicas" $.Values.gateway.replicas }}
{{- if include "servefleet.redisPasswordSecret" $ }}
{{- $_ := set $redis "password" (dict "file" (include "servefleet.redisPasswordFile" $)) }}
{{- end }}
{{- $_ := set $config "redis" $redis }}
{{- end }}
{{- with .Values.gateway.spilloverAllowedHosts }}
{{- $_ := set $config "spillover_allowed_hosts" . }}
{{- end }}
{{- with .Values.gateway.usagePrometheusURL }}
{{- $_ := set $config "usage_prometheus_url" . }}
{{- end }}
{{- with .Values.gateway.batch }}
{{- if .enabled }}
{{- $batch := dict "max_file_bytes" (int64 .maxFileBytes) }}
{{- if .s3.bucket }}
{{- $s3 := dict "bucket" .s3.bucket }}
{{- range $key := list "endpoint" "region" "prefix" }}
{{- with index $.Values.gateway.batch.s3 $key }}
{{- $_ := set $s3 $key . }}
{{- end }}
{{- end }}
{{- $_ := set $batch "s3" $s3 }}
{{- else }}
{{- $_ := set $batch "store_dir" (include "servefleet.batchDir" $) }}
{{- end }}
{{- $_ := set $config "batch" $batch }}
{{- end }}
{{- end }}
{{- toYaml (mergeOverwrite $config (deepCopy .Values.gateway.config)) }}
{{- end -}}
