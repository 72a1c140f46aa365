#!/usr/bin/env bash
# memtrain on a Kubernetes cluster with KubeRay (the Makefile's up/down/status/submit/grafana).
#   scripts/k8s.sh check               check every prerequisite of `up`, change nothing
#   scripts/k8s.sh render [OVERLAY]    print what `up` would apply (and the monitoring objects)
#   scripts/k8s.sh up [OVERLAY]        check prerequisites, create the token Secret, apply
#   scripts/k8s.sh down [OVERLAY]      delete the Ray cluster or job (volume and Secret kept)
#   scripts/k8s.sh status
#   scripts/k8s.sh submit CONFIG [memtrain submit options...]
#   scripts/k8s.sh data                the data step: text on the volume -> tokenized shards
#   scripts/k8s.sh grafana
# Environment (every fixed name is a variable; defaults in brackets):
#   IMAGE                 REGISTRY/memtrain:TAG that `make image` built and you pushed (`up`)
#   NAMESPACE             [memtrain]
#   STORAGE_CLASS         a ReadWriteMany StorageClass for the shared volume [the default class]
#   MONITORING_NAMESPACE  where kube-prometheus-stack runs [monitoring]
#   MONITORING_RELEASE    its Helm release, the label its Prometheus selects [kube-prometheus-stack]
#   GRAFANA_SERVICE       [$MONITORING_RELEASE-grafana]; PROMETHEUS_SERVICE [$MONITORING_RELEASE-prometheus]
#   ADDRESS               submit to this Jobs API URL instead of a port-forward (token: RAY_AUTH_TOKEN)
#   MEMTRAIN              the memtrain command [.venv/bin/memtrain]
set -euo pipefail
cd "$(dirname "$0")/.."
NAMESPACE=${NAMESPACE:-memtrain}
MEMTRAIN=${MEMTRAIN:-.venv/bin/memtrain}
KUBECTL=${KUBECTL:-kubectl}
MONITORING_NAMESPACE=${MONITORING_NAMESPACE:-${GRAFANA_NAMESPACE:-monitoring}}
MONITORING_RELEASE=${MONITORING_RELEASE:-kube-prometheus-stack}
GRAFANA_SERVICE=${GRAFANA_SERVICE:-$MONITORING_RELEASE-grafana}
PROMETHEUS_SERVICE=${PROMETHEUS_SERVICE:-$MONITORING_RELEASE-prometheus}
TOKEN_SECRET=memtrain-ray-token
HEAD_SERVICE=memtrain-head-svc
KUBERAY_MIN=1.6.0  # first release whose CRDs have authOptions.secretName (the token Secret)
KUBERAY_HELM="helm upgrade --install kuberay-operator kuberay/kuberay-operator --version 1.7.0"
PLACEHOLDER_TAG=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

die() { echo "k8s: $*" >&2; exit 1; }
say() { echo "k8s: $*"; }
# relative PATH DIR: PATH as seen from DIR (GNU realpath --relative-to is missing on macOS)
relative() { python3 -c 'import os, sys; print(os.path.relpath(sys.argv[1], sys.argv[2]))' "$1" "$2"; }

check_cluster() {  # kubectl, a context, a reachable API server
  command -v "$KUBECTL" >/dev/null || die "kubectl not found: install it (https://kubernetes.io/docs/tasks/tools/)"
  local context
  context=$("$KUBECTL" config current-context 2>/dev/null) \
    || die "no kubectl context: choose one with 'kubectl config use-context NAME'"
  "$KUBECTL" get --raw=/version --request-timeout=10s >/dev/null 2>&1 \
    || die "cannot reach the API server of context '$context'"
}

# The field each manifest kind needs, as a jsonpath into its CRD's v1 schema.
crd_field() {  # CRD PATH-UNDER-SPEC -> the field's type, or nothing
  "$KUBECTL" get crd "$1" -o "jsonpath={.spec.versions[?(@.name==\"v1\")].schema.openAPIV3Schema.properties.spec.$2.type}" 2>/dev/null || true
}

check_kuberay() {
  "$KUBECTL" get crd rayclusters.ray.io rayjobs.ray.io -o name >/dev/null 2>&1 \
    || die "KubeRay is not installed (CRDs rayclusters.ray.io, rayjobs.ray.io missing): $KUBERAY_HELM"
  [[ $(crd_field rayclusters.ray.io properties.authOptions.properties.secretName) == string &&
     $(crd_field rayjobs.ray.io properties.rayClusterSpec.properties.authOptions.properties.secretName) == string ]] \
    || die "KubeRay is older than $KUBERAY_MIN (its CRDs lack authOptions.secretName, the token Secret the manifests use): $KUBERAY_HELM"
}

check_image_format() {  # IMAGE names a tag (render and data take it unchecked otherwise)
  [[ $IMAGE == *:* && ${IMAGE##*:} != */* ]] || die "IMAGE must be REGISTRY/NAME:TAG, got '$IMAGE'"
}

check_image() {
  [[ -n ${IMAGE:-} ]] || die "IMAGE is not set: build and push the image (make image; docs/deploy.md), then IMAGE=REGISTRY/memtrain:TAG make up"
  check_image_format
  local tag=${IMAGE##*:}
  [[ $tag != latest && $tag != "$PLACEHOLDER_TAG" ]] \
    || die "IMAGE tag '$tag' names no build: use the <version>-<git revision> tag that make image printed (nodes keep a reused tag's old image)"
}

# Provisioners known to offer only ReadWriteOnce block volumes.
RWO_ONLY="ebs.csi.aws.com kubernetes.io/aws-ebs pd.csi.storage.gke.io kubernetes.io/gce-pd disk.csi.azure.com kubernetes.io/azure-disk rancher.io/local-path kubernetes.io/no-provisioner cinder.csi.openstack.org csi.hetzner.cloud dobs.csi.digitalocean.com"

check_storage() {  # the shared volume exists and is bound, or a class can make it ReadWriteMany
  local phase classes class provisioner
  phase=$("$KUBECTL" -n "$NAMESPACE" get pvc memtrain-shared -o jsonpath='{.status.phase}' 2>/dev/null || true)
  [[ $phase == Bound ]] && return
  classes=$("$KUBECTL" get storageclass -o 'jsonpath={range .items[*]}{.metadata.name}{" "}{.provisioner}{" "}{.metadata.annotations.storageclass\.kubernetes\.io/is-default-class}{"\n"}{end}' 2>/dev/null || true)
  if [[ -n ${STORAGE_CLASS:-} ]]; then
    class=$STORAGE_CLASS
    provisioner=$(awk -v c="$class" '$1 == c {print $2}' <<<"$classes")
    [[ -n $provisioner ]] || die "STORAGE_CLASS '$class' does not exist (classes: $(awk '{print $1}' <<<"$classes" | tr '\n' ' '))"
  else
    read -r class provisioner _ < <(awk '$3 == "true"' <<<"$classes") || true
    [[ -n ${class:-} ]] || die "no default StorageClass for the shared volume: set STORAGE_CLASS to a ReadWriteMany class (NFS, EFS, Filestore, CephFS, Azure Files)"
  fi
  [[ " $RWO_ONLY " != *" $provisioner "* ]] \
    || die "StorageClass '$class' ($provisioner) offers ReadWriteOnce only; the shared volume needs ReadWriteMany: set STORAGE_CLASS to an NFS, EFS, Filestore, CephFS or Azure Files class"
  STORAGE_CLASS=$class
}

check_gpus() {
  local total
  total=$("$KUBECTL" get nodes -o 'jsonpath={range .items[*]}{.status.allocatable.nvidia\.com/gpu}{" "}{end}' 2>/dev/null \
    | tr ' ' '\n' | awk '{s += $1} END {print s + 0}')
  [[ $total -gt 0 ]] || die "no node has allocatable nvidia.com/gpu: install the NVIDIA device plugin or GPU Operator (docs/deploy.md)"
}

check_monitoring() {  # a Prometheus that selects PodMonitors with our release label, if any
  has_prometheus_operator || return 0
  local found
  found=$("$KUBECTL" get prometheus -A -o 'jsonpath={range .items[*]}{.metadata.namespace}{" "}{.spec.podMonitorSelector.matchLabels.release}{"\n"}{end}' 2>/dev/null || true)
  awk -v ns="$MONITORING_NAMESPACE" -v r="$MONITORING_RELEASE" '$1 == ns && $2 == r {ok = 1} END {exit !ok}' <<<"$found" \
    || die "no Prometheus in namespace '$MONITORING_NAMESPACE' selects PodMonitors labelled release=$MONITORING_RELEASE (found: $(tr '\n' ';' <<<"$found" | sed 's/;$//')): set MONITORING_NAMESPACE and MONITORING_RELEASE"
}

preflight() {  # every prerequisite of `up`, in order; the first one missing stops it
  check_cluster
  check_kuberay
  check_image
  check_storage
  check_gpus
  check_monitoring
}

has_prometheus_operator() {
  "$KUBECTL" get crd podmonitors.monitoring.coreos.com prometheusrules.monitoring.coreos.com >/dev/null 2>&1
}

overlay_dir() {  # a temporary overlay: $IMAGE, the storage class and the monitoring names
  local overlay=k8s/overlays/${1:-cluster}
  [[ -f $overlay/kustomization.yaml ]] || die "no overlay '$1' (k8s/overlays/: $(ls k8s/overlays | tr '\n' ' '))"
  local tmp
  tmp=$(mktemp -d)
  cat > "$tmp/kustomization.yaml" <<YAML
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $(relative "$overlay" "$tmp")
configMapGenerator:
  - name: memtrain-monitoring
    namespace: $NAMESPACE
    behavior: replace
    literals:
      - RAY_GRAFANA_HOST=http://$GRAFANA_SERVICE.$MONITORING_NAMESPACE.svc
      - RAY_PROMETHEUS_HOST=http://$PROMETHEUS_SERVICE.$MONITORING_NAMESPACE.svc:9090
generatorOptions:
  disableNameSuffixHash: true
patches:
  - target: {kind: NetworkPolicy, name: memtrain-ray}
    patch: |
      - op: replace
        path: /spec/ingress/2/from/0/namespaceSelector/matchLabels/kubernetes.io~1metadata.name
        value: $MONITORING_NAMESPACE
YAML
  if [[ -n ${STORAGE_CLASS:-} ]]; then
    cat >> "$tmp/kustomization.yaml" <<YAML
  - target: {kind: PersistentVolumeClaim, name: memtrain-shared}
    patch: |
      - op: add
        path: /spec/storageClassName
        value: $STORAGE_CLASS
YAML
  fi
  if [[ -n ${IMAGE:-} ]]; then
    check_image_format
    local name=${IMAGE%:*} tag=${IMAGE##*:}
    printf 'images:\n  - name: memtrain\n    newName: %s\n    newTag: "%s"\n' "$name" "$tag" >> "$tmp/kustomization.yaml"
  fi
  echo "$tmp"
}

monitoring_dir() {  # k8s/monitoring with the release label the Prometheus selects
  local tmp
  tmp=$(mktemp -d)
  cat > "$tmp/kustomization.yaml" <<YAML
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: $NAMESPACE
resources:
  - $(relative k8s/monitoring "$tmp")
labels:
  - pairs:
      release: $MONITORING_RELEASE
YAML
  echo "$tmp"
}

DATA_SETTINGS=(TEXT TEXT_FIELD TOKENIZER VOCAB_SIZE SEQ_LEN OUT)

data_overlay_dir() {  # the data overlay (image swapped in) with the settings given in the environment
  local base tmp name literals=""
  base=$(overlay_dir data)
  tmp=$(mktemp -d)
  for name in "${DATA_SETTINGS[@]}"; do
    [[ -n ${!name:-} ]] && literals+="      - $name=${!name}"$'\n'
  done
  cat > "$tmp/kustomization.yaml" <<YAML
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $(relative "$base" "$tmp")
YAML
  if [[ -n $literals ]]; then
    printf 'configMapGenerator:\n  - name: memtrain-data\n    namespace: %s\n    behavior: merge\n    literals:\n%s' "$NAMESPACE" "$literals" >> "$tmp/kustomization.yaml"
  fi
  echo "$tmp"
}

ensure_token() {  # a random Ray token, made once; KubeRay hands it to every Ray container
  "$KUBECTL" create namespace "$NAMESPACE" --dry-run=client -o yaml | "$KUBECTL" apply -f - >/dev/null
  if ! "$KUBECTL" -n "$NAMESPACE" get secret "$TOKEN_SECRET" >/dev/null 2>&1; then
    "$KUBECTL" -n "$NAMESPACE" create secret generic "$TOKEN_SECRET" \
      --from-literal=auth_token="$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')" >/dev/null
    say "created Secret $NAMESPACE/$TOKEN_SECRET (Ray auth token)"
  fi
}

token() {
  "$KUBECTL" -n "$NAMESPACE" get secret "$TOKEN_SECRET" -o jsonpath='{.data.auth_token}' | base64 -d
}

cmd=${1:-}; shift || true
case "$cmd" in
  render)  # the manifests `up` (or `data`) would apply, with this environment's settings
    if [[ ${1:-cluster} == data ]]; then dir=$(data_overlay_dir); else dir=$(overlay_dir "${1:-cluster}"); fi
    "$KUBECTL" kustomize "$dir"
    [[ ${1:-cluster} == data ]] || { echo "---"; "$KUBECTL" kustomize "$(monitoring_dir)"; }
    ;;
  check)
    preflight
    say "every prerequisite of make up is there"
    ;;
  up)
    preflight
    dir=$(overlay_dir "${1:-cluster}")
    ensure_token
    "$KUBECTL" apply -k "$dir"
    if has_prometheus_operator; then
      "$KUBECTL" apply -k "$(monitoring_dir)"
    else
      say "Prometheus Operator CRDs not found: PodMonitors, PrometheusRule and dashboards skipped (install kube-prometheus-stack, then run make up again)"
    fi
    say "up; next: make status, make submit CONFIG=configs/gpt2-124m-8xgpu.yaml, make grafana"
    ;;
  down)
    check_cluster
    overlay=${1:-cluster}
    case "$overlay" in
      cluster) "$KUBECTL" -n "$NAMESPACE" delete -k k8s/raycluster --ignore-not-found ;;
      job) "$KUBECTL" -n "$NAMESPACE" delete -k k8s/rayjob --ignore-not-found ;;
      *) die "no overlay '$overlay' (cluster, job)" ;;
    esac
    say "deleted the Ray $overlay; kept: namespace $NAMESPACE, PVC memtrain-shared (data, checkpoints), Secret $TOKEN_SECRET"
    ;;
  status)
    check_cluster
    "$KUBECTL" -n "$NAMESPACE" get rayclusters,rayjobs,pods,pvc -o wide
    ;;
  submit)
    [[ $# -ge 1 ]] || die "usage: scripts/k8s.sh submit CONFIG [memtrain submit options]"
    config=$1; shift
    [[ -f $config ]] || die "config '$config' not found"
    if [[ -n ${ADDRESS:-} ]]; then  # a Jobs API reachable directly (VPN, in-cluster client)
      exec "$MEMTRAIN" submit --address "$ADDRESS" --config "$config" "$@"
    fi
    check_cluster
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    "$KUBECTL" -n "$NAMESPACE" port-forward --address 127.0.0.1 "svc/$HEAD_SERVICE" "$port:8265" >/dev/null &
    forward=$!
    trap 'kill $forward 2>/dev/null' EXIT
    for _ in $(seq 50); do
      (echo > "/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
      kill -0 $forward 2>/dev/null || die "port-forward to svc/$HEAD_SERVICE failed: is the cluster up (make status)?"
      sleep 0.2
    done
    RAY_AUTH_TOKEN=$(token) "$MEMTRAIN" submit --address "http://127.0.0.1:$port" --config "$config" "$@"
    ;;
  data)
    # The data step (k8s/jobs/data-job.yaml): text on the volume -> tokenizer -> shards. The
    # settings the Job reads (TEXT, TEXT_FIELD, TOKENIZER, VOCAB_SIZE, SEQ_LEN, OUT) may come
    # from the environment; unset, the ConfigMap's defaults hold.
    check_cluster
    dir=$(data_overlay_dir)
    "$KUBECTL" -n "$NAMESPACE" delete job memtrain-data --ignore-not-found >/dev/null
    "$KUBECTL" apply -k "$dir"
    say "waiting for the data Job's pod (its logs follow)"
    "$KUBECTL" -n "$NAMESPACE" wait --for=condition=Ready pod -l app.kubernetes.io/name=memtrain-data --timeout=600s >/dev/null \
      || "$KUBECTL" -n "$NAMESPACE" get pods -l app.kubernetes.io/name=memtrain-data
    "$KUBECTL" -n "$NAMESPACE" logs -f job/memtrain-data || true
    "$KUBECTL" -n "$NAMESPACE" wait --for=condition=complete job/memtrain-data --timeout=60s >/dev/null \
      || die "the data Job failed: kubectl -n $NAMESPACE logs job/memtrain-data"
    say "data written; next: make submit CONFIG=configs/gpt2-124m-8xgpu.yaml"
    ;;
  grafana)
    command -v "$KUBECTL" >/dev/null || die "kubectl not found"
    say "Grafana on http://127.0.0.1:3000 (Ctrl-C to stop)"
    exec "$KUBECTL" -n "$MONITORING_NAMESPACE" port-forward --address 127.0.0.1 \
      "svc/$GRAFANA_SERVICE" 3000:80
    ;;
  *)
    die "usage: scripts/k8s.sh check|render|up|down|status|submit|data|grafana"
    ;;
esac
