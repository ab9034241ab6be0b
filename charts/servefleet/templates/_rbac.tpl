{{- /*
The rules of each component, once; rbac.yaml binds them namespaced (Role + RoleBinding in
each watched namespace, the default) or cluster-wide (rbac.clusterWide). Each rule says why.
*/ -}}
{{- define "servefleet.rules.operator" -}}
# Watch LLMDeployments; patch their annotations (kopf keeps its handler state there).
- apiGroups: [servefleet.io]
  resources: [llmdeployments]
  verbs: [get, list, watch, patch]
# Status, by merge patch (queueDepth and podDeletionCosts excepted: the autoscaler's).
- apiGroups: [servefleet.io]
  resources: [llmdeployments/status]
  verbs: [patch]
# An unset spec.replicas is given the warm minimum once, through the scale subresource.
- apiGroups: [servefleet.io]
  resources: [llmdeployments/scale]
  verbs: [patch]
# Watch LLMAdapters (judged against their LLMDeployment, rendered into its route); patch
# their annotations (kopf's handler state). Their Secrets are never read: see operator/README.
- apiGroups: [servefleet.io]
  resources: [llmadapters]
  verbs: [get, list, watch, patch]
# The Accepted condition and the adapter config's rank and target modules (merge patch).
- apiGroups: [servefleet.io]
  resources: [llmadapters/status]
  verbs: [patch]
# Owner references with blockOwnerDeletion (OwnerReferencesPermissionEnforcement).
- apiGroups: [servefleet.io]
  resources: [llmdeployments/finalizers]
  verbs: [update]
# Children, written by server-side apply (create + patch); the garbage collector removes
# them through their owner references when the LLMDeployment goes. Deleted by hand only:
# the prefill pool's Deployment, Service, PodDisruptionBudget and ServiceMonitor when
# spec.disaggregation is removed (read first, deleted only when this LLMDeployment owns them),
# and the engine Deployment when replicas become groups of pods (a LeaderWorkerSet).
- apiGroups: [""]
  resources: [configmaps, services]
  verbs: [create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [create, patch]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors]
  verbs: [create, patch]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [create, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, delete]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors]
  verbs: [get, delete]
# The engine key Secret: created once when absent, never read (no get) nor rewritten.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
# The engine Deployment: applied, and watched to report readiness in status.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
# Replicas bigger than one pod: the engine workload is a LeaderWorkerSet
# (sigs.k8s.io/lws, installed by the admin): applied and read for status like the
# Deployment, deleted when replicas go back to one pod (only when this LLMDeployment owns
# it). Its pods are made by the LWS controller, under the LWS controller's own RBAC.
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, patch, delete]
# Engine pods: listed for ModelLoading and scale-downs; patched with the autoscaler's
# pod-deletion-cost ranking (status.podDeletionCosts), so the autoscaler writes no pod.
# It adds nothing the operator lacks: it may already create Deployments.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, patch]
# ModelLoading: engine pods' fetch init containers report download progress in their
# log, read here, so engine pods themselves need no API access.
- apiGroups: [""]
  resources: [pods/log]
  verbs: [get]
# Events on LLMDeployments.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}

{{- define "servefleet.rules.gateway" -}}
# Routes rendered (and signed) by the operator: list + watch with the label selector
# servefleet.io/gateway-route=true (RBAC cannot narrow a rule to a label).
- apiGroups: [""]
  resources: [configmaps]
  verbs: [list, watch]
# Tenant (and spill-over, engine) keys: only `get`, one Secret at a time, and only those a
# route names in its own namespace. No list/watch: those would return every Secret's data.
# Tenant keys are hashed on read; only the digests stay in memory.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
# Per-replica routing: the ready addresses of each engine headless Service.
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
{{- end -}}

{{- define "servefleet.rules.autoscaler" -}}
# Every tick lists the LLMDeployments of its namespaces.
- apiGroups: [servefleet.io]
  resources: [llmdeployments]
  verbs: [list]
# A disaggregated deployment's prefill pool has no scale subresource of its own: its
# spec.disaggregation.prefill.replicas is written by a merge patch of that one field.
- apiGroups: [servefleet.io]
  resources: [llmdeployments]
  verbs: [patch]
# Decisions go through the scale subresource, like an HPA's.
- apiGroups: [servefleet.io]
  resources: [llmdeployments/scale]
  verbs: [get, patch]
# status.queueDepth and, before a scale-down, status.podDeletionCosts (merge patch).
- apiGroups: [servefleet.io]
  resources: [llmdeployments/status]
  verbs: [patch]
# Where each LLMAdapter is loaded (status.loadedReplicas, its Loaded condition), as the
# gateways see it.
- apiGroups: [servefleet.io]
  resources: [llmadapters]
  verbs: [list]
- apiGroups: [servefleet.io]
  resources: [llmadapters/status]
  verbs: [patch]
# Engine pods: listed for replica states and addresses. Never written: the operator
# applies the deletion-cost ranking.
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
# "Scaled" Events on the LLMDeployment, saying why.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}
