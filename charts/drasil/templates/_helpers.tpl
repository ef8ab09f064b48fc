{{/* Names: every object is named after the release (<release>-drasil, or the release
name alone when it already says drasil), so two releases never collide. */}}
{{- define "drasil.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "drasil.pluginName" -}}
{{- printf "%s-kubelet-plugin" (include "drasil.fullname" .) -}}
{{- end -}}

{{- define "drasil.controllerName" -}}
{{- printf "%s-controller" (include "drasil.fullname" .) -}}
{{- end -}}

{{- define "drasil.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Selector labels of one component (kubelet-plugin or controller). */}}
{{- define "drasil.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "drasil.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "drasil.pluginServiceAccount" -}}
{{- include "drasil.pluginName" . -}}
{{- end -}}

{{- define "drasil.controllerServiceAccount" -}}
{{- include "drasil.controllerName" . -}}
{{- end -}}

{{/* The user name the API server gives a service account's tokens. */}}
{{- define "drasil.pluginUser" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "drasil.pluginServiceAccount" .) -}}
{{- end -}}

{{- define "drasil.controllerUser" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "drasil.controllerServiceAccount" .) -}}
{{- end -}}

{{/* The preset of names (compatibility): "" (drasil's own) or "nvidia-dra" (NVIDIA's DRA
driver's, docs/nvidia-dra.md). The schema allows nothing else; this refuses it too, for
installs that skip schema validation. */}}
{{- define "drasil.compatibility" -}}
{{- $preset := toString (.Values.compatibility | default "") -}}
{{- if not (has $preset (list "" "nvidia-dra")) -}}
{{- fail (printf "compatibility %q is not a preset of this chart: leave it empty (drasil's own names) or set nvidia-dra (the names of NVIDIA's DRA driver, docs/nvidia-dra.md)" $preset) -}}
{{- end -}}
{{- $preset -}}
{{- end -}}

{{/* The DRA driver name every template uses (never .Values.driverName directly): the
preset nvidia-dra makes it NVIDIA's gpu.nvidia.com, and refuses a driverName of the
user's own beside it. */}}
{{- define "drasil.driverName" -}}
{{- if eq (include "drasil.compatibility" .) "nvidia-dra" -}}
{{- if not (has .Values.driverName (list "gpu.drasil.dev" "gpu.nvidia.com")) -}}
{{- fail (printf "compatibility nvidia-dra sets the driver name gpu.nvidia.com, but driverName is %s: leave driverName at its default (gpu.drasil.dev) or set it to gpu.nvidia.com, or drop compatibility to keep %s" (toString .Values.driverName) (toString .Values.driverName)) -}}
{{- end -}}
gpu.nvidia.com
{{- else -}}
{{- .Values.driverName -}}
{{- end -}}
{{- end -}}

{{/* The kubelet plugin talks to the API server only in DRA mode. */}}
{{- define "drasil.pluginNeedsApi" -}}
{{- if eq .Values.mode "dra" -}}true{{- end -}}
{{- end -}}

{{/* The nvml backend needs the devices; the simulated one needs nothing of the host's. */}}
{{- define "drasil.pluginPrivileged" -}}
{{- if and (eq .Values.backend "nvml") .Values.nvml.privileged -}}true
{{- else if include "drasil.pluginMountsShm" . -}}true
{{- else if and (eq .Values.mode "dra") (eq .Values.amdPartitionMode "dynamic") -}}true
{{- else if include "drasil.pluginPassesThrough" . -}}true
{{- end -}}
{{- end -}}

{{/* GPUs passed through to VMs on real hardware (passthrough.enabled): the plugin
     rebinds PCI functions in sysfs, waits for the host's /dev/vfio/<group>, and looks
     through the host's processes for one using the GPU first. */}}
{{- define "drasil.pluginPassesThrough" -}}
{{- if and (eq .Values.mode "dra") .Values.passthrough.enabled (eq .Values.backend "nvml") -}}true{{- end -}}
{{- end -}}

{{/* MPS daemons (shares of consumable GPUs; GPUs and MIG devices allocated whole with
     an MPS config, mps.enabled, on with NVIDIA's preset): the plugin mounts each
     daemon's tmpfs under its state dir, and the host (the runtime that mounts it into
     clients) must see it. */}}
{{- define "drasil.pluginMountsShm" -}}
{{- if eq .Values.mode "dra" -}}
{{- if or (eq .Values.gpuSharing "consumable") .Values.mps.enabled (eq (include "drasil.compatibility" .) "nvidia-dra") -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{/* Overrides of the in-cluster API server address (apiServer.host/port). */}}
{{- define "drasil.apiServerEnv" -}}
{{- if .Values.apiServer.host }}
- name: KUBERNETES_SERVICE_HOST
  value: {{ .Values.apiServer.host | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ .Values.apiServer.port | quote }}
{{- end }}
{{- end -}}

{{/* The host directory of the NVIDIA driver: nvidiaDriverRoot, or the deprecated
nvml.driverRoot where that is set and nvidiaDriverRoot is left at its default "/". */}}
{{- define "drasil.nvidiaDriverRoot" -}}
{{- $root := .Values.nvidiaDriverRoot | default "/" -}}
{{- $old := (.Values.nvml | default dict).driverRoot -}}
{{- if and $old (eq $root "/") -}}
{{- $old -}}
{{- else -}}
{{- $root -}}
{{- end -}}
{{- end -}}

{{- /* The fields of each MPS daemon Pod the plugin takes from the chart (--mps-daemon-pod):
       the plugin Pod's tolerations, priority and pull settings, the daemon's resources. */ -}}
{{- define "drasil.mpsDaemonPod" -}}
{{- $plugin := .Values.kubeletPlugin -}}
{{- $pod := dict "imagePullPolicy" .Values.image.pullPolicy -}}
{{- with $plugin.tolerations }}{{ $_ := set $pod "tolerations" . }}{{ end -}}
{{- with $plugin.priorityClassName }}{{ $_ := set $pod "priorityClassName" . }}{{ end -}}
{{- with .Values.mps.resources }}{{ $_ := set $pod "resources" . }}{{ end -}}
{{- $secrets := list -}}
{{- range .Values.image.pullSecrets }}{{ $secrets = append $secrets (dict "name" .) }}{{ end -}}
{{- with $secrets }}{{ $_ := set $pod "imagePullSecrets" . }}{{ end -}}
{{- toJson $pod -}}
{{- end -}}

{{/* Whether the kubelet plugin patches its own Node's labels (DRA mode, nodeLabels on,
no NFD feature directory). */}}
{{- define "drasil.pluginPatchesNode" -}}
{{- and (eq .Values.mode "dra") (ne .Values.nodeLabels.names "off") (not .Values.nodeLabels.nfdFeaturesDir) -}}
{{- end -}}
