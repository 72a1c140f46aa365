#!/usr/bin/env bash
# The local single-node run (docker/compose.yaml) on a GPU workstation.
#   scripts/local.sh up     secrets (once), build, start, wait healthy, submit the demo job
#   scripts/local.sh down   stop the containers (volumes kept; `docker compose ... down -v` drops them)
# Needs Docker with the compose plugin and the NVIDIA Container Toolkit; the demo data and the
# project's virtual environment come from `make data` (the Makefile runs it first).
set -euo pipefail
cd "$(dirname "$0")/.."
COMPOSE=(docker compose -f docker/compose.yaml)
MEMTRAIN=${MEMTRAIN:-.venv/bin/memtrain}
CONFIG=${CONFIG:-configs/local-gpu.yaml}

die() { echo "local: $*" >&2; exit 1; }

secret() { python3 -c 'import secrets; print(secrets.token_urlsafe(32))'; }

write_secrets() {  # random, once, readable only by this user; never a default
  umask 077
  [[ -f docker/ray.env ]] || echo "RAY_AUTH_TOKEN=$(secret)" > docker/ray.env
  [[ -f docker/grafana.env ]] || echo "GF_SECURITY_ADMIN_PASSWORD=$(secret)" > docker/grafana.env
}

case "${1:-}" in
  up)
    command -v docker >/dev/null || die "docker not found: install Docker Engine with the compose plugin"
    docker compose version >/dev/null 2>&1 || die "'docker compose' not found: install the compose plugin"
    docker info >/dev/null 2>&1 || die "the Docker engine is not running (or this user may not use it)"
    write_secrets
    mkdir -p runs
    # The head writes checkpoints into runs/ as this host user, so any uid works; a root user
    # would make the container root, so it runs as the image's uid 1000 and gives it runs/.
    if [[ $(id -u) == 0 ]]; then
      chown 1000:1000 runs
      export MEMTRAIN_UID=1000 MEMTRAIN_GID=1000
    else
      MEMTRAIN_UID=$(id -u) MEMTRAIN_GID=$(id -g)
      export MEMTRAIN_UID MEMTRAIN_GID
    fi
    MEMTRAIN_VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
    MEMTRAIN_REVISION=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
    MEMTRAIN_TAG=$MEMTRAIN_VERSION-$MEMTRAIN_REVISION
    export MEMTRAIN_VERSION MEMTRAIN_REVISION MEMTRAIN_TAG
    "$MEMTRAIN" dashboards --ray monitoring/grafana/ray >/dev/null  # Ray's own, for Grafana
    "${COMPOSE[@]}" up -d --build --wait
    echo "local: Ray dashboard http://127.0.0.1:8265, Prometheus http://127.0.0.1:9090, Grafana http://127.0.0.1:3000 (admin, password in docker/grafana.env), MLflow http://127.0.0.1:5000"
    RAY_AUTH_TOKEN=$(sed -n 's/^RAY_AUTH_TOKEN=//p' docker/ray.env) \
      "$MEMTRAIN" submit --address http://127.0.0.1:8265 --config "$CONFIG" --follow
    ;;
  down)
    MEMTRAIN_TAG=any "${COMPOSE[@]}" down
    ;;
  *)
    die "usage: scripts/local.sh up|down"
    ;;
esac
