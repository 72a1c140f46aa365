"""k8s/: every overlay builds, passes the strictest offline validation available, and follows
the security policy. No API server runs here: core kinds are checked by kubernetes-validate
--strict, the KubeRay and Prometheus Operator kinds by jsonschema against ../shared/schemas/, and
the pod templates inside the custom resources as core Pods."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, require_tool

pytestmark = pytest.mark.deploy
K8S = REPO / "k8s"
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))
SCHEMAS = REPO.parent / "shared" / "schemas"
SCHEMA_FILES = {
    "RayCluster": "kuberay-v1.7.0/raycluster-ray-v1.schema.json",
    "RayJob": "kuberay-v1.7.0/rayjob-ray-v1.schema.json",
    "PodMonitor": "prometheus-operator-v0.93.0/podmonitor-monitoring-v1.schema.json",
    "PrometheusRule": "prometheus-operator-v0.93.0/prometheusrule-monitoring-v1.schema.json",
}
CORE_KINDS = {"Namespace", "PersistentVolumeClaim", "NetworkPolicy", "ConfigMap", "Secret",
              "Job"}


def kubectl() -> str:
    return require_tool("kubectl")


def build(directory: Path) -> list[dict[str, Any]]:
    out = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [o for o in yaml.safe_load_all(out.stdout) if o]


@pytest.fixture(scope="module")
def built() -> dict[str, list[dict[str, Any]]]:
    return {path.name: build(path) for path in [*OVERLAYS, K8S / "monitoring"]}


def pod_specs(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(where, pod spec) for every pod template inside a RayCluster, RayJob or Job."""
    if obj["kind"] == "Job":
        return [("job", obj["spec"]["template"]["spec"])]
    if obj["kind"] not in ("RayCluster", "RayJob"):
        return []
    spec = obj["spec"]
    cluster = spec.get("rayClusterSpec", spec)
    found = [("head", cluster["headGroupSpec"]["template"]["spec"])]
    found += [(g["groupName"], g["template"]["spec"]) for g in cluster["workerGroupSpecs"]]
    if "submitterPodTemplate" in spec:
        found.append(("submitter", spec["submitterPodTemplate"]["spec"]))
    return found


def all_objects(built: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [obj for objects in built.values() for obj in objects]


def test_the_expected_overlays_exist_and_build(built: dict[str, list[dict[str, Any]]]) -> None:
    assert {"cluster", "job", "data"} <= set(built)
    kinds = {name: sorted(o["kind"] for o in objects) for name, objects in built.items()}
    assert kinds["cluster"] == ["ConfigMap", "Namespace", "NetworkPolicy",
                                "PersistentVolumeClaim", "RayCluster"]
    assert kinds["job"] == ["ConfigMap", "Namespace", "NetworkPolicy", "PersistentVolumeClaim",
                            "RayJob"]
    assert kinds["data"] == ["ConfigMap", "ConfigMap", "Job", "Namespace", "NetworkPolicy",
                             "PersistentVolumeClaim"]
    assert kinds["monitoring"] == ["ConfigMap", "PodMonitor", "PodMonitor", "PrometheusRule"]
    for obj in all_objects(built):
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "memtrain", obj["metadata"]["name"]


def test_core_kinds_and_embedded_pods_pass_kubernetes_validate_strict(
        built: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    documents = [o for o in all_objects(built) if o["kind"] in CORE_KINDS]
    for obj in all_objects(built):  # the pod templates inside the custom resources, as Pods
        for where, spec in pod_specs(obj):
            documents.append({"apiVersion": "v1", "kind": "Pod", "spec": spec, "metadata": {
                "name": f"{obj['metadata']['name']}-{where}", "namespace": "memtrain"}})
    core = {o["kind"] for o in documents}
    assert core >= {"Namespace", "PersistentVolumeClaim", "NetworkPolicy", "ConfigMap", "Pod",
                    "Job"}
    path = tmp_path / "core.yaml"
    path.write_text(yaml.safe_dump_all(documents))
    validate = Path(sys.executable).parent / "kubernetes-validate"
    out = subprocess.run([str(validate), "--strict", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("passed for resource") == len(documents), out.stdout


def test_custom_resources_pass_the_crd_schemas(built: dict[str, list[dict[str, Any]]]) -> None:
    if not SCHEMAS.is_dir():
        pytest.skip(f"{SCHEMAS} is absent (a user's machine): CRD schema checks need it")
    import jsonschema

    checked = set()
    for obj in all_objects(built):
        if obj["kind"] not in SCHEMA_FILES:
            continue
        schema = json.loads((SCHEMAS / SCHEMA_FILES[obj["kind"]]).read_text())
        jsonschema.validate(obj, schema)  # structural: required fields, types, enums
        checked.add(obj["kind"])
    assert checked == set(SCHEMA_FILES)


def test_ray_clusters_follow_kuberay_conventions(built: dict[str, list[dict[str, Any]]]) -> None:
    rays = [o for o in all_objects(built) if o["kind"] in ("RayCluster", "RayJob")]
    assert len(rays) == 2
    for obj in rays:
        cluster = obj["spec"].get("rayClusterSpec", obj["spec"])
        assert cluster["authOptions"]["mode"] == "token"  # Ray's token auth stays on
        groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
        for group in groups:
            assert all(isinstance(v, str) for v in group["rayStartParams"].values()), group
        for group in cluster["workerGroupSpecs"]:
            assert {"minReplicas", "maxReplicas", "replicas"} <= set(group)
            limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
            assert int(limits["nvidia.com/gpu"]) >= 1
        for group in groups:
            spec = group["template"]["spec"]
            ray_container = spec["containers"][0]  # KubeRay treats the first as Ray's
            assert ray_container["name"].startswith("ray-")
            assert {"containerPort": 8080, "name": "metrics"} in ray_container["ports"]
            shm = [m for m in ray_container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
            [volume] = [v for v in spec["volumes"] if v["name"] == shm[0]["name"]]
            assert volume["emptyDir"]["medium"] == "Memory"


def render(overlay: str, **env: str) -> list[dict[str, Any]]:
    """What `make up` would apply for ``overlay`` with these settings (scripts/k8s.sh render)."""
    settings = {k: v for k, v in os.environ.items()
                if k not in ("IMAGE", "STORAGE_CLASS", "TOKENIZER") and not k.startswith(
                    ("MONITORING_", "GRAFANA_", "PROMETHEUS_"))}
    out = subprocess.run(["bash", str(REPO / "scripts" / "k8s.sh"), "render", overlay],
                         capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**settings, "KUBECTL": kubectl(), **env})
    assert out.returncode == 0, out.stderr
    return [o for o in yaml.safe_load_all(out.stdout) if o]


FAKE_KUBECTL = REPO / "tests" / "deploy" / "kubectl"


def k8s_script(command: str, answers: list[list[Any]], **env: str
               ) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """scripts/k8s.sh COMMAND against a stand-in kubectl that gives ``answers`` (recorded
    outputs: [regex of the arguments, exit code, stdout]); returns the run and kubectl's calls."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        scenario, log = Path(tmp) / "answers.json", Path(tmp) / "calls.log"
        scenario.write_text(json.dumps(answers))
        log.touch()
        settings = {k: v for k, v in os.environ.items()
                    if k not in ("IMAGE", "STORAGE_CLASS", "KUBECONFIG") and not k.startswith(
                        ("MONITORING_", "GRAFANA_", "PROMETHEUS_"))}
        out = subprocess.run(["bash", str(REPO / "scripts" / "k8s.sh"), command],
                             capture_output=True, text=True, cwd=REPO, timeout=60,
                             env={**settings, "KUBECTL": str(FAKE_KUBECTL / "fake_kubectl.py"),
                                  "FAKE_KUBECTL": str(scenario), "FAKE_KUBECTL_LOG": str(log),
                                  **env})
        return out, log.read_text().splitlines()


def head_env(objects: list[dict[str, Any]], kind: str) -> dict[str, str]:
    """The head container's environment: its env entries and the ConfigMaps it loads."""
    [obj] = [o for o in objects if o["kind"] == kind]
    cluster = obj["spec"].get("rayClusterSpec", obj["spec"])
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in head.get("env", [])}
    for source in head.get("envFrom", []):
        if "configMapRef" in source:
            [config_map] = [o for o in objects if o["kind"] == "ConfigMap"
                            and o["metadata"]["name"] == source["configMapRef"]["name"]]
            env.update(config_map["data"])
    return env


@pytest.mark.parametrize("overlay, kind", [("cluster", "RayCluster"), ("job", "RayJob")])
def test_rays_web_ui_embeds_the_grafana_that_make_grafana_forwards(overlay: str,
                                                                   kind: str) -> None:
    script = (REPO / "scripts" / "k8s.sh").read_text()
    local_port = re.search(r'port-forward .*\n?.*" (\d+):80', script).group(1)  # type: ignore[union-attr]
    env = head_env(render(overlay), kind)  # kube-prometheus-stack's defaults
    assert env["RAY_GRAFANA_HOST"] == "http://kube-prometheus-stack-grafana.monitoring.svc"
    assert env["RAY_PROMETHEUS_HOST"] == \
        "http://kube-prometheus-stack-prometheus.monitoring.svc:9090"
    assert env["RAY_GRAFANA_IFRAME_HOST"] == f"http://127.0.0.1:{local_port}"
    out, calls = k8s_script("grafana", [[r"port-forward", 0, ""]], MONITORING_NAMESPACE="obs",
                            MONITORING_RELEASE="prom")
    assert out.returncode == 0, out.stderr
    assert calls == ["-n obs port-forward --address 127.0.0.1 svc/prom-grafana 3000:80"]


def test_the_monitoring_names_are_settings_not_fixed(tmp_path: Path) -> None:
    objects = render("cluster", MONITORING_NAMESPACE="obs", MONITORING_RELEASE="prom",
                     STORAGE_CLASS="nfs-rwx")
    env = head_env(objects, "RayCluster")
    assert env["RAY_GRAFANA_HOST"] == "http://prom-grafana.obs.svc"
    assert env["RAY_PROMETHEUS_HOST"] == "http://prom-prometheus.obs.svc:9090"
    [policy] = [o for o in objects if o["kind"] == "NetworkPolicy"]
    scrapers = [s["namespaceSelector"]["matchLabels"] for rule in policy["spec"]["ingress"]
                for s in rule["from"] if s.get("namespaceSelector")]
    assert {"kubernetes.io/metadata.name": "obs"} in scrapers
    assert {"kubernetes.io/metadata.name": "monitoring"} not in scrapers
    monitors = [o for o in objects if o["kind"] in ("PodMonitor", "PrometheusRule")]
    assert len(monitors) == 3 and all(m["metadata"]["labels"]["release"] == "prom"
                                      for m in monitors)
    [claim] = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"]["storageClassName"] == "nfs-rwx"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_the_rayjob_runs_the_same_cluster_as_the_raycluster() -> None:
    raycluster = yaml.safe_load((K8S / "raycluster" / "raycluster.yaml").read_text())
    rayjob = yaml.safe_load((K8S / "rayjob" / "rayjob.yaml").read_text())
    assert rayjob["spec"]["rayClusterSpec"] == raycluster["spec"]
    assert rayjob["spec"]["shutdownAfterJobFinishes"] is True
    config = rayjob["spec"]["entrypoint"].split("--config ")[1].split()[0]
    assert (REPO / config.removeprefix("/app/")).is_file()  # the image copies configs/ to /app


def test_no_manifest_runs_privileged_on_the_host_or_as_root(
        built: dict[str, list[dict[str, Any]]]) -> None:
    specs = [(f"{o['kind']}/{where}", spec) for o in all_objects(built)
             for where, spec in pod_specs(o)]
    assert len(specs) == 6  # cluster head + gpu, job head + gpu + submitter, the data Job
    for where, spec in specs:
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(key), (where, key)
        assert not any("hostPath" in v for v in spec.get("volumes", [])), where
        pod_security = spec["securityContext"]
        assert pod_security["runAsNonRoot"] is True and pod_security["runAsUser"] != 0, where
        assert pod_security["seccompProfile"]["type"] == "RuntimeDefault", where
        for container in spec["containers"]:
            security = container["securityContext"]
            assert security.get("privileged") is not True, where
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["capabilities"]["drop"] == ["ALL"], where
            assert security.get("runAsUser", 1000) != 0, where
            resources = container["resources"]
            assert resources["requests"] and resources["limits"], where


def test_the_jobs_api_is_reachable_only_from_the_namespace_or_labelled_clients(
        built: dict[str, list[dict[str, Any]]]) -> None:
    [policy] = [o for o in built["cluster"] if o["kind"] == "NetworkPolicy"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule.get("ports", [])}
        for source in rule["from"]:
            assert "ipBlock" not in source  # never opened to addresses
            if "namespaceSelector" in source and source["namespaceSelector"] == {}:
                # any namespace: only for labelled pods, and only the Jobs API / client ports
                assert source["podSelector"]["matchLabels"], source
                assert ports <= {8265, 10001}
            elif "namespaceSelector" in source:
                assert ports == {8080}  # Prometheus scrapes metrics only
            else:
                assert source == {"podSelector": {}}  # this namespace
    pod_labels = [spec_labels for o in built["cluster"] if o["kind"] == "RayCluster"
                  for spec_labels in [o["spec"]["headGroupSpec"]["template"]["metadata"]
                                      ["labels"]]]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert all(selector.items() <= labels.items() for labels in pod_labels)


def test_pod_monitors_select_the_ray_pods_by_their_metrics_port(
        built: dict[str, list[dict[str, Any]]]) -> None:
    [raycluster] = [o for o in built["cluster"] if o["kind"] == "RayCluster"]
    labels = raycluster["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    monitors = [o for o in built["monitoring"] if o["kind"] == "PodMonitor"]
    assert sorted(m["spec"]["selector"]["matchLabels"]["ray.io/node-type"]
                  for m in monitors) == ["head", "worker"]
    for monitor in monitors:
        selector = dict(monitor["spec"]["selector"]["matchLabels"])
        selector.pop("ray.io/node-type")  # set by KubeRay on its pods
        assert selector.items() <= labels.items()
        assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]


def test_an_image_override_reaches_every_container() -> None:
    """`make up IMAGE=...` writes a temporary overlay; it must rename every memtrain image."""
    objects = render("job", IMAGE="registry.example.com/team/memtrain:0.2.0-0123456789ab")
    images = {c["image"] for o in objects for _, spec in pod_specs(o)
              for c in spec["containers"] + spec.get("initContainers", [])}
    assert images == {"registry.example.com/team/memtrain:0.2.0-0123456789ab"}


def _data_settings(objects: list[dict[str, Any]]) -> dict[str, str]:
    [job] = [o for o in objects if o["kind"] == "Job"]
    [ref] = [e["configMapRef"]["name"] for e in job["spec"]["template"]["spec"]["containers"][0]
             ["envFrom"]]
    [config_map] = [o for o in objects if o["kind"] == "ConfigMap"
                    and o["metadata"]["name"] == ref]
    return config_map["data"]


def test_the_data_job_writes_what_the_cluster_config_reads(
        built: dict[str, list[dict[str, Any]]]) -> None:
    """`make cluster-data` then `make submit CONFIG=configs/gpt2-124m-8xgpu.yaml`: the Job's
    output, sequence length and vocabulary are the config's, on the volume the Ray pods mount."""
    from trainer.config import load_config

    settings = _data_settings(built["data"])
    cfg = load_config(REPO / "configs" / "gpt2-124m-8xgpu.yaml")
    assert f"{settings['OUT']}/train" == cfg.data.path
    assert f"{settings['OUT']}/val" == cfg.data.val_path
    assert int(settings["SEQ_LEN"]) == cfg.model.seq_len
    assert int(settings["VOCAB_SIZE"]) == cfg.model.vocab_size
    [job] = [o for o in built["data"] if o["kind"] == "Job"]
    spec = job["spec"]["template"]["spec"]
    [claim] = [v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]]
    assert claim == "memtrain-shared"
    assert {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]} == {"/mnt/memtrain"}
    for path in (settings["TEXT"], settings["TOKENIZER"], settings["OUT"]):
        assert path.startswith("/mnt/memtrain/")
    script = spec["containers"][0]["args"][0]
    for command in ("data tokenizer train", "data write", "--tokenizer"):
        assert command in script  # the CLI's own commands (tests/unit/test_tokenize.py)


def test_make_cluster_data_passes_its_settings_to_the_job() -> None:
    objects = render("data", TEXT="/mnt/memtrain/corpus", VOCAB_SIZE="32768",
                     IMAGE="registry.example.com/memtrain:0.2.0-0123456789ab")
    settings = _data_settings(objects)
    assert settings["TEXT"] == "/mnt/memtrain/corpus" and settings["VOCAB_SIZE"] == "32768"
    assert settings["TOKENIZER"] == "/mnt/memtrain/data/tokenizer.json"  # the default kept
    [job] = [o for o in objects if o["kind"] == "Job"]
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == \
        "registry.example.com/memtrain:0.2.0-0123456789ab"


@pytest.mark.parametrize("kubeconfig, message", [
    ("/nonexistent", "k8s: no kubectl context: choose one with 'kubectl config use-context NAME'"),
    ("dead", "k8s: cannot reach the API server of context 'dead'"),
])
def test_make_up_names_the_missing_prerequisite(kubeconfig: str, message: str,
                                                tmp_path: Path) -> None:
    kubectl()
    if kubeconfig == "dead":  # a context whose API server does not answer (loopback port 1)
        kubeconfig = str(tmp_path / "config")
        Path(kubeconfig).write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "dead",
            "clusters": [{"name": "dead", "cluster": {"server": "https://127.0.0.1:1"}}],
            "contexts": [{"name": "dead", "context": {"cluster": "dead", "user": "u"}}],
            "users": [{"name": "u", "user": {"token": "x"}}]}))
    out = subprocess.run(["make", "--no-print-directory", "up"], capture_output=True,
                         text=True, cwd=REPO, env={**os.environ, "KUBECONFIG": kubeconfig},
                         timeout=60)
    assert out.returncode != 0
    assert message in out.stderr


@pytest.mark.parametrize("target", ["up", "down", "status", "submit", "grafana", "local",
                                    "local-down"])
def test_every_deployment_target_dry_runs(target: str) -> None:
    out = subprocess.run(["make", "-n", target], capture_output=True, text=True, cwd=REPO,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "scripts/" in out.stdout


HEALTHY: list[list[Any]] = json.loads((FAKE_KUBECTL / "healthy.json").read_text())
GOOD_IMAGE = {"IMAGE": "registry.example.com/memtrain:0.1.0-0123456789ab"}


def answers(changes: dict[str, tuple[int, str]]) -> list[list[Any]]:
    """The healthy cluster's recorded outputs, with the answers whose regex contains a key
    replaced by (exit code, stdout)."""
    out = []
    for pattern, code, stdout in HEALTHY:
        for key, (new_code, new_stdout) in changes.items():
            if key in pattern:
                code, stdout = new_code, new_stdout
        out.append([pattern, code, stdout])
    return out


def test_make_up_checks_pass_on_a_cluster_that_has_everything() -> None:
    out, calls = k8s_script("check", HEALTHY, **GOOD_IMAGE)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "k8s: every prerequisite of make up is there"
    assert not [c for c in calls if c.startswith(("apply", "create", "delete"))]


CRDS = "get crd rayclusters.ray.io rayjobs.ray.io -o name"
RC_SECRET = "get crd rayclusters.ray.io -o jsonpath"
RJ_SECRET = "get crd rayjobs.ray.io -o jsonpath"


@pytest.mark.parametrize("changes, env, message", [
    ({CRDS: (1, "")}, GOOD_IMAGE,
     "KubeRay is not installed (CRDs rayclusters.ray.io, rayjobs.ray.io missing)"),
    # KubeRay 1.5.x: the CRDs exist, without authOptions.secretName (first in 1.6.0)
    ({RC_SECRET: (0, ""), RJ_SECRET: (0, "")}, GOOD_IMAGE,
     "KubeRay is older than 1.6.0 (its CRDs lack authOptions.secretName"),
    ({RJ_SECRET: (0, "")}, GOOD_IMAGE, "KubeRay is older than 1.6.0"),
    ({}, {}, "IMAGE is not set: build and push the image (make image"),
    ({}, {"IMAGE": "registry.example.com/memtrain:0.1.0"}, "IMAGE tag '0.1.0' names no build"),
    ({}, {"IMAGE": "registry.example.com/memtrain:latest"}, "IMAGE tag 'latest' names no build"),
    ({"get storageclass": (0, "standard-rwo pd.csi.storage.gke.io \n")}, GOOD_IMAGE,
     "no default StorageClass for the shared volume: set STORAGE_CLASS"),
    ({"get storageclass": (0, "standard-rwo pd.csi.storage.gke.io true\n")}, GOOD_IMAGE,
     "StorageClass 'standard-rwo' (pd.csi.storage.gke.io) offers ReadWriteOnce only"),
    ({}, {**GOOD_IMAGE, "STORAGE_CLASS": "standard-rwo"},
     "StorageClass 'standard-rwo' (pd.csi.storage.gke.io) offers ReadWriteOnce only"),
    ({}, {**GOOD_IMAGE, "STORAGE_CLASS": "nfs"}, "STORAGE_CLASS 'nfs' does not exist "
                                                 "(classes: standard-rwo filestore-rwx"),
    ({"get nodes": (0, "  ")}, GOOD_IMAGE, "no node has allocatable nvidia.com/gpu"),
    ({"get prometheus": (0, "observability prom\n")}, GOOD_IMAGE,
     "no Prometheus in namespace 'monitoring' selects PodMonitors labelled "
     "release=kube-prometheus-stack (found: observability prom)"),
])
def test_make_up_names_the_first_missing_prerequisite_and_changes_nothing(
        changes: dict[str, tuple[int, str]], env: dict[str, str], message: str) -> None:
    out, calls = k8s_script("up", answers(changes), **env)
    assert out.returncode == 1
    [line] = out.stderr.strip().splitlines()
    assert line.startswith(f"k8s: {message}"), line
    assert not [c for c in calls if c.startswith(("apply", "create", "-n memtrain create"))]


def test_a_bound_volume_and_the_named_monitoring_release_pass() -> None:
    """An existing, bound shared volume needs no class check; MONITORING_* pick the install."""
    changed = answers({"get storageclass": (0, "standard-rwo pd.csi.storage.gke.io true\n"),
                       "get prometheus": (0, "observability prom\n")})
    changed.insert(0, ["^-n memtrain get pvc memtrain-shared", 0, "Bound"])
    out, _ = k8s_script("check", changed, **GOOD_IMAGE, MONITORING_NAMESPACE="observability",
                        MONITORING_RELEASE="prom")
    assert out.returncode == 0, out.stderr


def test_the_shared_volume_is_made_writable_for_uid_1000_by_a_narrow_root_init_step(
        built: dict[str, list[dict[str, Any]]]) -> None:
    for obj in (o for o in all_objects(built) if o["kind"] in ("RayCluster", "RayJob")):
        cluster = obj["spec"].get("rayClusterSpec", obj["spec"])
        spec = cluster["headGroupSpec"]["template"]["spec"]
        assert spec["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
        owner, check = spec["initContainers"]
        assert owner["securityContext"]["runAsUser"] == 0  # the one root step: chown alone
        assert owner["securityContext"]["capabilities"] == {
            "drop": ["ALL"], "add": ["CHOWN", "DAC_OVERRIDE", "FOWNER"]}
        assert owner["securityContext"]["allowPrivilegeEscalation"] is False
        assert "chown 1000:1000 /mnt/memtrain/runs" in owner["args"][0]
        assert "runAsUser" not in check["securityContext"]  # the pod's uid 1000
        assert "not writable by uid 1000" in check["args"][0]
        for init in (owner, check):
            assert [m["mountPath"] for m in init["volumeMounts"]] == ["/mnt/memtrain"]
