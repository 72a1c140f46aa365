from __future__ import annotations

import json

import pytest

from monitoring.dashboards import CUDA_PANELS, DASHBOARDS, OUT_DIR, panel_queries, render
from monitoring.metrics import METRICS


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
