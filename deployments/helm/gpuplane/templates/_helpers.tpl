{{/*
Helpers shared by the templates. Object names are fixed (gpuplane-node, gpuplane-controller,
...), not derived from the release name: the admission policies, the RBAC and the webhook
configurations name them, and the DeviceClasses, the CRD and the policies are cluster-wide, so
a cluster holds one gpuplane release.
*/}}

{{/* The image of both workloads: repository:tag, the tag defaulting to the chart's appVersion. */}}
{{- define "gpuplane.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* A service account's user name as the API server sees it: the admission policies match it. */}}
{{- define "gpuplane.serviceAccountUser" -}}
system:serviceaccount:{{ .root.Release.Namespace }}:{{ .name }}
{{- end -}}

{{/*
The controller's --time-sliced flags (a YAML list), from the agents' config
(config.sharing.timeSlicing), so the quota controller charges a replica 1/replicas of a GPU under
the name the agents advertise: `rename`, else `<name>.shared` with renameByDefault, else the name.
*/}}
{{- define "gpuplane.timeSlicedArgs" -}}
{{- $ts := dig "sharing" "timeSlicing" dict .Values.config -}}
{{- $args := list -}}
{{- range $r := ($ts.resources | default list) -}}
{{- $name := $r.name -}}
{{- if $r.rename -}}
{{- $name = $r.rename -}}
{{- else if $ts.renameByDefault -}}
{{- $name = printf "%s.shared" $r.name -}}
{{- end -}}
{{- $args = append $args (printf "--time-sliced=%s=%v" $name $r.replicas) -}}
{{- end -}}
{{- toYaml $args -}}
{{- end -}}

{{/*
Where the webhook configurations get their CA: cert-manager's CA injector (this annotation), or
webhookCertificate.caBundle (gpuplane.caBundle) with a Secret the user made.
*/}}
{{- define "gpuplane.webhookAnnotations" -}}
{{- if not .Values.webhookCertificate.existingSecret -}}
annotations:
  cert-manager.io/inject-ca-from: {{ .Release.Namespace }}/gpuplane-webhook
{{- end -}}
{{- end -}}

{{/* clientConfig.caBundle (base64 of the PEM) when the user brings the Secret. */}}
{{- define "gpuplane.caBundle" -}}
{{- if .Values.webhookCertificate.existingSecret -}}
caBundle: {{ .Values.webhookCertificate.caBundle | b64enc }}
{{- end -}}
{{- end -}}
