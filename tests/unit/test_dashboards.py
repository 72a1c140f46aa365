from __future__ import annotations

import json

import pytest

from monitoring.dashboards import CUDA_PANELS, DASHBOARDS, OUT_DIR, render
from monitoring.metrics import METRICS
from tests.conftest import panel_queries


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_committed_json_is_what_the_code_generates(name: str) -> None:
    committed = (OUT_DIR / name).read_text()
    assert committed == render(name), f"run `make dashboards`: {name} is out of date"


def test_dashboards_have_the_template_variables_and_only_contract_metrics() -> None:
    names = {m.exposed_name for m in METRICS}
    titles = set()
    for name in DASHBOARDS:
        rendered = render(name)
        board = json.loads(rendered)
        assert [v["name"] for v in board["templating"]["list"]] == \
            ["datasource", "run", "rank", "node"]
        for title, expr in panel_queries(rendered):
            titles.add(title)
            used = {token for token in
                    expr.replace("(", " ").replace("{", " ").replace(")", " ").split()
                    if token.startswith("ray_memtrain_")}
            bare = {u.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
                    for u in used}
            assert bare <= names, f"{title}: {bare - names} not in the contract"
            assert '$run' in expr, f"{title} ignores the run variable"
    assert CUDA_PANELS <= titles


def test_committed_configmap_is_what_the_code_generates() -> None:
    from monitoring.dashboards import CONFIGMAP_PATH, render_configmap

    assert CONFIGMAP_PATH.read_text() == render_configmap(), "run `make dashboards`"


def test_committed_prometheus_rule_is_rules_yml() -> None:
    import yaml

    from monitoring.dashboards import PROMETHEUS_RULE_PATH, RULES_PATH, render_prometheus_rule

    assert PROMETHEUS_RULE_PATH.read_text() == render_prometheus_rule(), "run `make dashboards`"
    rule = yaml.safe_load(PROMETHEUS_RULE_PATH.read_text())
    assert rule["spec"]["groups"] == yaml.safe_load(RULES_PATH.read_text())["groups"]


def test_configmap_builds_with_kustomize_and_carries_the_sidecar_label() -> None:
    import subprocess

    import yaml

    from monitoring.dashboards import CONFIGMAP_PATH
    from tests.conftest import require_tool

    kubectl = require_tool("kubectl")
    built = subprocess.run([kubectl, "kustomize", str(CONFIGMAP_PATH.parent)],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    [configmap] = [o for o in yaml.safe_load_all(built) if o["kind"] == "ConfigMap"]
    assert configmap["kind"] == "ConfigMap"
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert sorted(configmap["data"]) == sorted(DASHBOARDS)
    for name, text in configmap["data"].items():
        assert json.loads(text)["uid"] == name.removesuffix(".json")
