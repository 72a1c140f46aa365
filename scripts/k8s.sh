#!/usr/bin/env bash
# memtrain on a Kubernetes cluster with KubeRay (the Makefile's up/down/status/submit/grafana).
#   scripts/k8s.sh up [OVERLAY]        check prerequisites, create the token Secret, apply
#   scripts/k8s.sh down [OVERLAY]      delete the Ray cluster or job (volume and Secret kept)
#   scripts/k8s.sh status
#   scripts/k8s.sh submit CONFIG [memtrain submit options...]
#   scripts/k8s.sh data                the data step: text on the volume -> tokenized shards
#   scripts/k8s.sh grafana
# Environment: IMAGE (registry/memtrain:tag for `up`), NAMESPACE (memtrain), ADDRESS (submit
# to this Jobs API URL instead of a port-forward; the token from RAY_AUTH_TOKEN),
# GRAFANA_NAMESPACE (monitoring), GRAFANA_SERVICE (kube-prometheus-stack-grafana),
# MEMTRAIN (.venv/bin/memtrain).
set -euo pipefail
cd "$(dirname "$0")/.."
NAMESPACE=${NAMESPACE:-memtrain}
MEMTRAIN=${MEMTRAIN:-.venv/bin/memtrain}
KUBECTL=${KUBECTL:-kubectl}
TOKEN_SECRET=memtrain-ray-token
HEAD_SERVICE=memtrain-head-svc

die() { echo "k8s: $*" >&2; exit 1; }
say() { echo "k8s: $*"; }
# relative PATH DIR: PATH as seen from DIR (GNU realpath --relative-to is missing on macOS)
relative() { python3 -c 'import os, sys; print(os.path.relpath(sys.argv[1], sys.argv[2]))' "$1" "$2"; }

check_cluster() {  # kubectl, a context, a reachable API server, KubeRay's CRDs
  command -v "$KUBECTL" >/dev/null || die "kubectl not found: install it (https://kubernetes.io/docs/tasks/tools/)"
  local context
  context=$("$KUBECTL" config current-context 2>/dev/null) \
    || die "no kubectl context: choose one with 'kubectl config use-context NAME'"
  "$KUBECTL" get --raw=/version --request-timeout=10s >/dev/null 2>&1 \
    || die "cannot reach the API server of context '$context'"
  "$KUBECTL" get crd rayclusters.ray.io rayjobs.ray.io >/dev/null 2>&1 \
    || die "KubeRay is not installed (CRDs rayclusters.ray.io, rayjobs.ray.io missing): helm install kuberay-operator kuberay/kuberay-operator --version 1.7.0"
}

has_prometheus_operator() {
  "$KUBECTL" get crd podmonitors.monitoring.coreos.com prometheusrules.monitoring.coreos.com >/dev/null 2>&1
}

overlay_dir() {  # the overlay, or a temporary one that swaps in $IMAGE
  local overlay=k8s/overlays/${1:-cluster}
  [[ -f $overlay/kustomization.yaml ]] || die "no overlay '$1' (k8s/overlays/: $(ls k8s/overlays | tr '\n' ' '))"
  if [[ -z ${IMAGE:-} ]]; then echo "$overlay"; return; fi
  local tmp name=${IMAGE%:*} tag=${IMAGE##*:}
  [[ $IMAGE == *:* && $tag != */* ]] || die "IMAGE must be REGISTRY/NAME:TAG, got '$IMAGE'"
  tmp=$(mktemp -d)
  cat > "$tmp/kustomization.yaml" <<YAML
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $(relative "$overlay" "$tmp")
images:
  - name: memtrain
    newName: $name
    newTag: "$tag"
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
  up)
    check_cluster
    dir=$(overlay_dir "${1:-cluster}")
    ensure_token
    "$KUBECTL" apply -k "$dir"
    if has_prometheus_operator; then
      "$KUBECTL" apply -k k8s/monitoring
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
    exec "$KUBECTL" -n "${GRAFANA_NAMESPACE:-monitoring}" port-forward --address 127.0.0.1 \
      "svc/${GRAFANA_SERVICE:-kube-prometheus-stack-grafana}" 3000:80
    ;;
  *)
    die "usage: scripts/k8s.sh up|down|status|submit|data|grafana"
    ;;
esac
