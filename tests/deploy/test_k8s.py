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
    assert kinds["cluster"] == ["Namespace", "NetworkPolicy", "PersistentVolumeClaim",
                                "RayCluster"]
    assert kinds["job"] == ["Namespace", "NetworkPolicy", "PersistentVolumeClaim", "RayJob"]
    assert kinds["data"] == ["ConfigMap", "Job", "Namespace", "NetworkPolicy",
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


def test_rays_web_ui_embeds_the_grafana_that_make_grafana_forwards(
        built: dict[str, list[dict[str, Any]]]) -> None:
    script = (REPO / "scripts" / "k8s.sh").read_text()
    namespace = re.search(r'GRAFANA_NAMESPACE:-([\w-]+)', script).group(1)
    service = re.search(r'GRAFANA_SERVICE:-([\w-]+)', script).group(1)
    local_port = re.search(r'port-forward .*\n?.*" (\d+):80', script).group(1)
    for obj in (o for o in all_objects(built) if o["kind"] in ("RayCluster", "RayJob")):
        cluster = obj["spec"].get("rayClusterSpec", obj["spec"])
        head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e["value"] for e in head.get("env", [])}
        assert env["RAY_GRAFANA_HOST"] == f"http://{service}.{namespace}.svc", obj["kind"]
        assert env["RAY_PROMETHEUS_HOST"].startswith(f"http://kube-prometheus-stack-prometheus."
                                                     f"{namespace}.svc:"), obj["kind"]
        assert env["RAY_GRAFANA_IFRAME_HOST"] == f"http://127.0.0.1:{local_port}", obj["kind"]


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


def test_an_image_override_reaches_every_container(tmp_path: Path) -> None:
    """`make up IMAGE=...` writes a temporary overlay; it must rename every memtrain image."""
    script = REPO / "scripts" / "k8s.sh"
    env = {**os.environ, "IMAGE": "registry.example.com/team/memtrain:0.2.0"}
    code = (f'source <(sed -n "/^overlay_dir()/,/^}}/p;/^die()/p;/^relative()/p" {script}); '
            "overlay_dir job")
    out = subprocess.run(["bash", "-c", code], capture_output=True, text=True, env=env,
                         cwd=REPO, check=True)
    objects = build(Path(out.stdout.strip()))
    images = {c["image"] for o in objects for _, spec in pod_specs(o)
              for c in spec["containers"]}
    assert images == {"registry.example.com/team/memtrain:0.2.0"}


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


def test_make_cluster_data_passes_its_settings_to_the_job(tmp_path: Path) -> None:
    script = REPO / "scripts" / "k8s.sh"
    code = (f'source <(sed -n "/^overlay_dir()/,/^}}/p;/^data_overlay_dir()/,/^}}/p;'
            f'/^die()/p;/^relative()/p;/^DATA_SETTINGS=/p" {script}); NAMESPACE=memtrain; '
            'data_overlay_dir')
    env = {**os.environ, "TEXT": "/mnt/memtrain/corpus", "VOCAB_SIZE": "32768",
           "IMAGE": "registry.example.com/memtrain:0.2.0"}
    env.pop("TOKENIZER", None)
    out = subprocess.run(["bash", "-c", code], capture_output=True, text=True, env=env,
                         cwd=REPO, check=True)
    objects = build(Path(out.stdout.strip()))
    settings = _data_settings(objects)
    assert settings["TEXT"] == "/mnt/memtrain/corpus" and settings["VOCAB_SIZE"] == "32768"
    assert settings["TOKENIZER"] == "/mnt/memtrain/data/tokenizer.json"  # the default kept
    [job] = [o for o in objects if o["kind"] == "Job"]
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == \
        "registry.example.com/memtrain:0.2.0"


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
