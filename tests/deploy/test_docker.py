"""docker/: the image and the local single-node run, validated offline (no Docker engine here):
hadolint on the Dockerfile, the compose specification's schema on compose.yaml, promtool on the
compose Prometheus config, and the project's own rules: loopback-only ports, no default
secrets, non-root containers, one set of versions everywhere."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, require_tool

pytestmark = pytest.mark.deploy
DOCKER = REPO / "docker"
BIN = Path(sys.executable).parent


def compose() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_dockerfile_passes_hadolint() -> None:
    out = subprocess.run([str(BIN / "hadolint"), str(DOCKER / "Dockerfile")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_passes_the_compose_spec_schema() -> None:
    out = subprocess.run([str(BIN / "check-jsonschema"), "--builtin-schema",
                          "vendor.compose-spec", str(DOCKER / "compose.yaml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_published_port_is_bound_to_loopback() -> None:
    published = [(name, port) for name, service in compose()["services"].items()
                 for port in service.get("ports", [])]
    assert {name for name, _ in published} == {"ray-head", "prometheus", "grafana", "mlflow"}
    for name, port in published:
        assert isinstance(port, str) and port.startswith("127.0.0.1:"), (name, port)


def test_secrets_come_from_ignored_env_files_never_defaults() -> None:
    services = compose()["services"]
    grafana, head = services["grafana"], services["ray-head"]
    assert "GF_SECURITY_ADMIN_PASSWORD" not in grafana.get("environment", {})
    assert [f["path"] for f in grafana["env_file"]] == ["grafana.env"]
    assert all(f["required"] for f in grafana["env_file"] + head["env_file"])
    assert head["environment"]["RAY_AUTH_MODE"] == "token"
    ignored = subprocess.run(["git", "check-ignore", "docker/grafana.env", "docker/ray.env"],
                             capture_output=True, text=True, cwd=REPO)
    assert ignored.stdout.split() == ["docker/grafana.env", "docker/ray.env"]


def test_containers_run_as_non_root_without_capabilities() -> None:
    dockerfile = (DOCKER / "Dockerfile").read_text()
    users = re.findall(r"^USER (\S+)", dockerfile, flags=re.M)
    assert users and not users[-1].startswith(("0", "root")), users
    for name, service in compose()["services"].items():
        assert service["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in service["security_opt"], name
        assert not service.get("privileged") and service.get("network_mode") != "host", name
        if "user" in service:
            assert not service["user"].startswith(("0:", "root")), name
        else:
            assert service.get("build"), f"{name}: set user (its image's default may be root)"


def test_the_head_gets_the_gpus_and_shared_memory() -> None:
    head = compose()["services"]["ray-head"]
    [device] = head["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["count"] == "all"
    assert head["shm_size"]


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """target -> host path of a service's bind mounts, short and long syntax."""
    mounts = {}
    for m in service.get("volumes", []):
        if isinstance(m, dict) and m["type"] == "bind":
            mounts[m["target"]] = (DOCKER / m["source"]).resolve()
        elif isinstance(m, str) and m.startswith("."):
            mounts[m.split(":")[1]] = (DOCKER / m.split(":")[0]).resolve()
    return mounts


def test_grafana_and_prometheus_mount_what_monitoring_ships() -> None:
    services = compose()["services"]
    mounts = {**bind_mounts(services["grafana"]), **bind_mounts(services["prometheus"])}
    ray_dashboards = REPO / "monitoring/grafana/ray"
    for target, source in mounts.items():
        assert source.exists() or source == ray_dashboards, (target, source)
    providers = {p["name"]: p["options"]["path"] for p in yaml.safe_load(
        (REPO / "monitoring/grafana/provisioning/dashboards/memtrain.yml").read_text()
    )["providers"]}
    assert mounts[providers["memtrain"]] == (REPO / "monitoring/grafana/dashboards").resolve()
    # Ray's own dashboards: written by `make local` where Grafana reads them, never committed.
    assert mounts[providers["ray"]] == ray_dashboards
    assert "dashboards --ray monitoring/grafana/ray" in (REPO / "scripts/local.sh").read_text()
    assert "/monitoring/grafana/ray/" in (REPO / ".gitignore").read_text().splitlines()
    prometheus = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    assert prometheus["rule_files"] == ["rules.yml"]
    assert mounts["/etc/prometheus/rules.yml"] == (REPO / "monitoring/prometheus/rules.yml")
    assert services["grafana"]["image"] == "grafana/grafana:11.6.0"


def test_rays_web_ui_reaches_grafana_and_prometheus_and_grafana_allows_embedding() -> None:
    services = compose()["services"]
    env = services["ray-head"]["environment"]
    # in the compose network: service name and container port; in the browser: the published one
    assert env["RAY_GRAFANA_HOST"] == "http://grafana:3000"
    assert env["RAY_PROMETHEUS_HOST"] == "http://prometheus:9090"
    assert "127.0.0.1:3000:3000" in services["grafana"]["ports"]
    assert env["RAY_GRAFANA_IFRAME_HOST"] == "http://127.0.0.1:3000"
    assert "127.0.0.1:9090:9090" in services["prometheus"]["ports"]
    assert services["grafana"]["environment"]["GF_SECURITY_ALLOW_EMBEDDING"] == "true"
    assert services["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"


def test_the_mlflow_service_is_the_images_own_server_and_the_head_logs_to_it() -> None:
    """Its command's options are the installed mlflow's (``mlflow server --help``), the image's
    lock has mlflow, and jobs on the head get the service's URI."""
    services = compose()["services"]
    mlflow, head = services["mlflow"], services["ray-head"]
    assert mlflow["image"] == head["image"] and mlflow["user"] == head["user"]
    assert head["environment"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert mlflow["ports"] == ["127.0.0.1:5000:5000"]
    assert "--host=0.0.0.0" in mlflow["command"] and "mlflow:5000" in " ".join(mlflow["command"])
    assert mlflow["command"][:2] == ["mlflow", "server"]
    usage = subprocess.run([sys.executable, "-m", "mlflow", "server", "--help"],
                           capture_output=True, text=True, timeout=120)
    assert usage.returncode == 0, usage.stderr[-2000:]
    for option in mlflow["command"][2:]:
        assert option.split("=")[0] in usage.stdout, option
    for variant in ("gpu", "cpu"):
        assert re.search(r"^mlflow==", (DOCKER / "requirements" / f"{variant}.txt").read_text(),
                         flags=re.M), variant


def test_the_compose_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    promtool = require_tool("promtool", " (Debian's prometheus package; `make test` installs it)")
    shutil.copy(DOCKER / "prometheus.yml", tmp_path / "prometheus.yml")
    shutil.copy(REPO / "monitoring/prometheus/rules.yml", tmp_path / "rules.yml")
    out = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _dockerignored(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    ignored = False
    for line in (REPO / ".dockerignore").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!").rstrip("/")
        parts = path.split("/")  # a pattern naming a folder names everything in it
        if any(fnmatch.fnmatch("/".join(parts[:n]), pattern) for n in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


def test_everything_the_dockerfile_copies_is_in_the_build_context() -> None:
    sources = [source.replace("${VARIANT}", variant)
               for line in (DOCKER / "Dockerfile").read_text().splitlines()
               if line.startswith("COPY ") and "--from=" not in line
               for source in line.split()[1:-1] if not source.startswith("--")
               for variant in ("gpu", "cpu")]
    assert {"docker/requirements/gpu.txt", "docker/requirements/cpu.txt", "trainer",
            "configs"} <= set(sources)
    for source in sources:
        assert (REPO / source).exists() and not _dockerignored(source), source
    assert _dockerignored(".venv") and _dockerignored("data") and _dockerignored(".git")
    assert _dockerignored("docker/ray.env") and _dockerignored("tests")


def test_versions_agree_across_pyproject_locks_dockerfile_compose_and_manifests() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = dict(re.match(r"([a-z]+)(?:\[[^]]*\])?==(\S+)", d).groups()  # type: ignore[union-attr]
                for d in project["optional-dependencies"]["train"]
                if re.match(r"(torch|ray)\b.*==", d))
    assert pins == {"torch": "2.13.0", "ray": "2.60.0"}
    version = project["version"]

    for variant, torch in (("gpu", "2.13.0"), ("cpu", "2.13.0+cpu")):
        lock = (DOCKER / "requirements" / f"{variant}.txt").read_text()
        assert f"\ntorch=={torch} \\\n" in lock and f"\nray=={pins['ray']} \\\n" in lock
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert f"torch.__version__.startswith('{pins['torch']}')" in dockerfile
    assert f"ray.__version__ == '{pins['ray']}'" in dockerfile
    assert f"ARG VERSION={version}\n" in dockerfile
    assert 'org.opencontainers.image.version="${VERSION}"' in dockerfile
    assert compose()["services"]["ray-head"]["image"] == "memtrain:${MEMTRAIN_TAG:?" \
        "run make local, which sets it}"

    manifests = [yaml.safe_load(p.read_text())
                 for p in ((REPO / "k8s/raycluster/raycluster.yaml"),
                           (REPO / "k8s/rayjob/rayjob.yaml"))]
    for manifest in manifests:
        cluster = manifest["spec"].get("rayClusterSpec", manifest["spec"])
        assert cluster["rayVersion"] == pins["ray"]
    images = set(re.findall(r"image: (\S+)", "".join(
        p.read_text() for p in (REPO / "k8s").rglob("*.yaml"))))
    assert images == {f"memtrain:{version}"}


def test_the_image_runs_debians_python_311_which_the_locks_are_resolved_for() -> None:
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert "ARG BASE=docker.io/library/debian:bookworm-slim" in dockerfile  # Python 3.11
    assert "sys.version_info[:2] == (3, 11)" in dockerfile
    assert '"--python-version", "3.11"' in (REPO / "scripts/lock.py").read_text()


def test_the_locks_are_fresh_hashed_and_differ_only_in_torchs_build() -> None:
    out = subprocess.run([sys.executable, str(REPO / "scripts/lock.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    locks = {}
    for variant in ("gpu", "cpu"):
        text = (DOCKER / "requirements" / f"{variant}.txt").read_text()
        pins = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+) \\\n((?:    --hash=sha256:[0-9a-f]{64}"
                          r"(?: \\)?\n)+)", text, flags=re.M)
        # every requirement line is a pin with at least one hash
        assert len(pins) == len(re.findall(r"^[A-Za-z0-9]", text, flags=re.M)), variant
        locks[variant] = {name.lower(): version for name, version, _ in pins}
    gpu, cpu = locks["gpu"], locks["cpu"]
    cuda = set(gpu) - set(cpu)  # CUDA's runtime libraries, bundled as wheels, and triton
    assert {"nvidia-cublas", "nvidia-cudnn-cu13", "nvidia-nccl-cu13", "triton"} <= cuda
    assert all(n.startswith(("nvidia-", "cuda-")) or n == "triton" for n in cuda), cuda
    assert set(cpu) <= set(gpu)
    assert {n: v for n, v in cpu.items() if gpu[n] != v} == {"torch": "2.13.0+cpu"}
    # everything the image's extras name is in both
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for requirement in project["dependencies"] + [r for extra in _lock_script().EXTRAS
                                                  for r in extras[extra]]:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()  # type: ignore[union-attr]
        assert all(name.replace("_", "-") in lock for lock in locks.values()), name


def _lock_script() -> Any:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import lock
    finally:
        sys.path.pop(0)
    return lock


def test_the_image_locks_every_extra_a_documented_feature_needs() -> None:
    """A cluster runs the image, so it holds every feature's packages: the memory strategies
    (peft for model.lora; torchao for 8-bit, 4-bit and bf16 optimizer states and bf16 weights)
    as much as training, Hugging Face models and trackers. Only the developer's tools and the
    benchmarks' peers stay out."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert set(_lock_script().EXTRAS) == set(extras) - {"dev", "bench"}
    for variant in ("gpu", "cpu"):
        lock = (DOCKER / "requirements" / f"{variant}.txt").read_text()
        for requirement in extras["strategies"]:  # pinned in pyproject.toml: the same here
            assert f"\n{requirement} \\\n" in lock, (variant, requirement)


def test_a_changed_dependency_makes_the_locks_stale(tmp_path: Path) -> None:
    lock = _lock_script()
    changed = tmp_path / "pyproject.toml"
    changed.write_text((REPO / "pyproject.toml").read_text().replace(
        '"pyarrow>=17"', '"pyarrow>=18"'))
    assert lock.inputs_digest(changed) != lock.inputs_digest()
    assert lock.recorded_digest(DOCKER / "requirements" / "gpu.txt") == lock.inputs_digest()


def test_make_local_names_a_missing_docker_engine_before_writing_anything() -> None:
    probe = subprocess.run(["docker", "info"], capture_output=True, timeout=30) \
        if shutil.which("docker") else None
    if probe is not None and probe.returncode == 0:
        pytest.skip("a Docker engine runs here: `make local` would really start the stack")
    secrets = [DOCKER / "ray.env", DOCKER / "grafana.env"]
    existed = [p.exists() for p in secrets]
    out = subprocess.run(["bash", str(REPO / "scripts" / "local.sh"), "up"], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    assert out.returncode == 1
    assert out.stderr.strip() in {
        "local: docker not found: install Docker Engine with the compose plugin",
        "local: 'docker compose' not found: install the compose plugin",
        "local: the Docker engine is not running (or this user may not use it)"}
    assert [p.exists() for p in secrets] == existed  # nothing written before the check


def test_the_local_head_runs_as_the_host_user_and_a_tag_per_revision() -> None:
    """`make local` passes the host user's uid and gid (1000 and a chowned runs/ for root), so
    the bind-mounted runs/ is writable whoever runs it (checked for real by image_check.py's
    uid-4242 run); the image is tagged with the git revision."""
    head = compose()["services"]["ray-head"]
    assert head["user"] == "${MEMTRAIN_UID:-1000}:${MEMTRAIN_GID:-1000}"
    assert head["environment"]["HOME"] == "/tmp"  # the image's home belongs to uid 1000
    assert head["build"]["args"]["REVISION"] == "${MEMTRAIN_REVISION:-unknown}"
    script = (REPO / "scripts" / "local.sh").read_text()
    for line in ("chown 1000:1000 runs", "MEMTRAIN_UID=$(id -u) MEMTRAIN_GID=$(id -g)",
                 "MEMTRAIN_TAG=$MEMTRAIN_VERSION-$MEMTRAIN_REVISION",
                 "export MEMTRAIN_VERSION MEMTRAIN_REVISION MEMTRAIN_TAG"):
        assert line in script, line
