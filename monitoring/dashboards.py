"""Grafana dashboards as code (grafana-foundation-sdk, Grafana 11.6 schemas).

Two dashboards, "Training memory" and "Training throughput", one function per panel, queries
written against the contract's final names (``monitoring/metrics.py``) so they serve Ray's
endpoint and the standalone exporter alike. ``write_dashboards`` generates deterministic JSON
(sorted keys) into ``monitoring/grafana/dashboards/``; a test fails when the committed JSON
differs from what this code generates, and the e2e test runs every panel's query against a real
Prometheus (the panels in ``CUDA_PANELS`` need a GPU and are checked with recorded statistics
and by ``make gpu-check``). Nobody edits the JSON by hand: ``make dashboards``.
"""

from __future__ import annotations

import json
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

OUT_DIR = Path(__file__).resolve().parent / "grafana" / "dashboards"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SELECTOR = 'run=~"$run", rank=~"$rank", node=~"$node"'
RATE = "$__rate_interval"
# Panels whose series exist only on CUDA workers (absent, not zero, on CPU); the last two also
# need dcgm-exporter's series.
CUDA_PANELS = frozenset({
    "Allocated, reserved and peak per rank", "Fragmentation (inactive split / reserved)",
    "Allocator retries and OOMs", "Device memory used against total",
    "Peak memory skew across ranks", "Framebuffer (dcgm-exporter) against PyTorch, per GPU",
    "Device memory outside PyTorch's cache, per GPU",
})
# dcgm-exporter's framebuffer-used gauge (MiB), relabelled so it joins memtrain's gpu_uuid.
DCGM_FB_USED_BYTES = ('max by (gpu_uuid) (label_replace(DCGM_FI_DEV_FB_USED, "gpu_uuid", "$1", '
                      '"UUID", "(.+)")) * 1048576')


def query(expr: str, legend: str, ref_id: str = "A") -> prometheus.Dataquery:
    return (prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref_id)
            .datasource(DATASOURCE))


def panel(title: str, unit: str, *queries: prometheus.Dataquery,
          description: str = "") -> timeseries.Panel:
    built = (timeseries.Panel().title(title).unit(unit).datasource(DATASOURCE)
             .description(description).height(8).span(12))
    for q in queries:
        built = built.with_target(q)
    return built


def variables(builder: dashboard.Dashboard) -> dashboard.Dashboard:
    """``datasource``, then ``run``, ``rank`` and ``node``, each narrowing the next."""
    builder = builder.with_variable(
        dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
    chain = [("run", "ray_memtrain_train_tokens_total"),
             ("rank", 'ray_memtrain_train_tokens_total{run=~"$run"}'),
             ("node", 'ray_memtrain_train_tokens_total{run=~"$run"}')]
    for name, series in chain:
        builder = builder.with_variable(
            dashboard.QueryVariable(name).label(name).datasource(DATASOURCE)
            .query(f"label_values({series}, {name})").multi(True).include_all(True)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED))
    return builder


# ---- Training memory -------------------------------------------------------------------------

def memory_per_rank() -> timeseries.Panel:
    return panel("Allocated, reserved and peak per rank", "bytes",
                 query(f"ray_memtrain_gpu_memory_allocated_bytes{{{SELECTOR}}}",
                       "rank {{rank}} allocated", "A"),
                 query(f"ray_memtrain_gpu_memory_reserved_bytes{{{SELECTOR}}}",
                       "rank {{rank}} reserved", "B"),
                 query(f"ray_memtrain_gpu_memory_peak_allocated_bytes{{{SELECTOR}}}",
                       "rank {{rank}} peak (interval)", "C"),
                 description="PyTorch caching allocator per worker. The peak is the highest "
                             "in the last monitoring.peak_window_seconds (60 s by default), so "
                             "a one-step spike shows in every scrape of that window.")


def fragmentation() -> timeseries.Panel:
    return panel("Fragmentation (inactive split / reserved)", "percentunit",
                 query(f"ray_memtrain_gpu_memory_inactive_split_bytes{{{SELECTOR}}} / "
                       f"ray_memtrain_gpu_memory_reserved_bytes{{{SELECTOR}}}", "rank {{rank}}"),
                 description="Reserved memory the allocator cannot hand out whole.")


def retries_and_ooms() -> timeseries.Panel:
    return panel("Allocator retries and OOMs", "short",
                 query(f"increase(ray_memtrain_gpu_alloc_retries_total{{{SELECTOR}}}[{RATE}])",
                       "rank {{rank}} retries", "A"),
                 query(f"increase(ray_memtrain_gpu_ooms_total{{{SELECTOR}}}[{RATE}])",
                       "rank {{rank}} OOMs", "B"))


def device_used_vs_total() -> timeseries.Panel:
    return panel("Device memory used against total", "bytes",
                 query(f"ray_memtrain_gpu_device_used_bytes{{{SELECTOR}}}", "rank {{rank}} used",
                       "A"),
                 query(f"ray_memtrain_gpu_device_total_bytes{{{SELECTOR}}}",
                       "rank {{rank}} total", "B"),
                 description="NVML's view: every process on the device, not only PyTorch's.")


def host_memory() -> timeseries.Panel:
    return panel("Host memory per rank", "bytes",
                 query(f"ray_memtrain_host_rss_bytes{{{SELECTOR}}}", "rank {{rank}} RSS", "A"),
                 query(f"ray_memtrain_host_pinned_bytes{{{SELECTOR}}}", "rank {{rank}} pinned",
                       "B"))


def memory_skew() -> timeseries.Panel:
    peak = f"ray_memtrain_gpu_memory_peak_allocated_bytes{{{SELECTOR}}}"
    return panel("Peak memory skew across ranks", "percentunit",
                 query(f"(max by (run) ({peak}) - min by (run) ({peak})) / max by (run) ({peak})",
                       "{{run}}"),
                 description="The fullest rank decides when a job runs out of memory.")


def dcgm_against_pytorch() -> timeseries.Panel:
    reserved = f"ray_memtrain_gpu_memory_reserved_bytes{{{SELECTOR}}}"
    return panel("Framebuffer (dcgm-exporter) against PyTorch, per GPU", "bytes",
                 query(f"{DCGM_FB_USED_BYTES} and on (gpu_uuid) group by (gpu_uuid) ({reserved})",
                       "{{gpu_uuid}} framebuffer used (dcgm)", "A"),
                 query(f"sum by (gpu_uuid) ({reserved})", "{{gpu_uuid}} reserved (PyTorch)", "B"),
                 query(f"sum by (gpu_uuid) (ray_memtrain_gpu_memory_allocated_bytes{{{SELECTOR}}})",
                       "{{gpu_uuid}} allocated (PyTorch)", "C"),
                 description="The GPUs of the selected runs, joined on the GPU UUID: "
                             "dcgm-exporter's DCGM_FI_DEV_FB_USED beside the caching "
                             "allocator's view. Empty without dcgm-exporter.")


def outside_pytorch() -> timeseries.Panel:
    reserved = f"ray_memtrain_gpu_memory_reserved_bytes{{{SELECTOR}}}"
    return panel("Device memory outside PyTorch's cache, per GPU", "bytes",
                 query(f"{DCGM_FB_USED_BYTES} - on (gpu_uuid) sum by (gpu_uuid) ({reserved})",
                       "{{gpu_uuid}}"),
                 description="Framebuffer used minus what PyTorch reserved: the CUDA context, "
                             "NCCL and library workspaces, and other processes on the GPU.")


def assemble(title: str, uid: str, panels: list[timeseries.Panel],
             rows: tuple[tuple[str, list[timeseries.Panel]], ...] = ()) -> dashboard.Dashboard:
    """A dashboard with the shared variables, time range and refresh, panels numbered from 1,
    then each (title, panels) row."""
    builder = variables(dashboard.Dashboard(title).uid(uid).tags(["memtrain", "generated"])
                        .time("now-1h", "now").refresh("30s").editable())
    panel_id = 0
    for made in panels:
        panel_id += 1
        builder = builder.with_panel(made.id(panel_id))
    for row_title, row_panels in rows:
        panel_id += 1
        builder = builder.with_row(dashboard.Row(row_title).id(panel_id))
        for made in row_panels:
            panel_id += 1
            builder = builder.with_panel(made.id(panel_id))
    return builder


def memory_dashboard() -> dashboard.Dashboard:
    return assemble("Training memory", "memtrain-memory",
                    [memory_per_rank(), fragmentation(), retries_and_ooms(),
                     device_used_vs_total(), host_memory(), memory_skew()],
                    rows=(("With dcgm-exporter", [dcgm_against_pytorch(), outside_pytorch()]),))


# ---- Training throughput ---------------------------------------------------------------------

def tokens_per_second() -> timeseries.Panel:
    return panel("Tokens per second", "short",
                 query("sum by (run) "
                       f"(rate(ray_memtrain_train_tokens_total{{{SELECTOR}}}[{RATE}]))", "{{run}}"))


def step_time() -> timeseries.Panel:
    buckets = f"rate(ray_memtrain_train_step_seconds_bucket{{{SELECTOR}}}[{RATE}])"
    return panel("Step time p50 and p95", "s",
                 query(f"histogram_quantile(0.5, sum by (le, run) ({buckets}))", "{{run}} p50",
                       "A"),
                 query(f"histogram_quantile(0.95, sum by (le, run) ({buckets}))", "{{run}} p95",
                       "B"))


def data_wait_share() -> timeseries.Panel:
    return panel("Data wait share of step time", "percentunit",
                 query(f"rate(ray_memtrain_data_wait_seconds_total{{{SELECTOR}}}[{RATE}]) / "
                       f"rate(ray_memtrain_train_step_seconds_sum{{{SELECTOR}}}[{RATE}])",
                       "rank {{rank}}"))


def checkpoint_time() -> timeseries.Panel:
    return panel("Checkpoint time", "s",
                 query(f"increase(ray_memtrain_checkpoint_seconds_total{{{SELECTOR}}}[{RATE}])",
                       "saving, rank {{rank}}"),
                 query(f"increase(ray_memtrain_checkpoint_blocking_seconds_total{{{SELECTOR}}}"
                       f"[{RATE}])", "step waited, rank {{rank}}"),
                 description="Seconds spent saving checkpoints per interval, and how many of "
                             "them the training step waited for: all of a save's in the step, "
                             "the staging alone with train.checkpoint_async.")


def loss() -> timeseries.Panel:
    return panel("Loss", "short",
                 query(f"ray_memtrain_train_loss{{{SELECTOR}}}", "rank {{rank}}"))


def grad_scale() -> timeseries.Panel:
    return panel("Grad scale", "short",
                 query(f"ray_memtrain_train_grad_scale{{{SELECTOR}}}", "rank {{rank}}"),
                 description="fp16's GradScaler scale; 1 without one. A falling scale means "
                             "overflowing gradients.")


def batch_split() -> timeseries.Panel:
    return panel("Micro-batch and accumulation", "short",
                 query(f"ray_memtrain_train_micro_batch_size{{{SELECTOR}}}",
                       "rank {{rank}} micro-batch", "A"),
                 query(f"ray_memtrain_train_accumulation_steps{{{SELECTOR}}}",
                       "rank {{rank}} accumulation", "B"),
                 description="Changes under auto and after OOM recovery; their product stays.")


def world_size() -> timeseries.Panel:
    return panel("World size and resizes", "short",
                 query(f"max by (run) (ray_memtrain_train_world_size{{{SELECTOR}}})",
                       "{{run}} workers", "A"),
                 # Ray exports no counter before its first increment: 0 when nothing resized.
                 query("sum by (run) (increase(ray_memtrain_train_world_size_changes_total"
                       f"{{{SELECTOR}}}[{RATE}])) or on () vector(0)", "{{run}} resizes", "B"),
                 description="Workers in the running group, and resumes at another size (an "
                             "elastic resize, a lost node): the global batch is kept by the "
                             "accumulation steps.")


def restarts() -> timeseries.Panel:
    return panel("Restarts by cause", "short",
                 # rank 0 publishes the whole run's count; each attempt is a new process (a new
                 # series), so the latest value is the run's, and 0 before the first restart.
                 query("max by (run, cause) (ray_memtrain_train_restarts_total{run=~\"$run\"})"
                       " or on () vector(0)", "{{run}} after {{cause}}"),
                 description="Restarts after a failure, the whole run's (rank 0's log has one "
                             "line each: `restarted after ...`): worker_error (a worker's own "
                             "error), controller_error (Ray Train's controller, on the store), "
                             "node_lost, resize (an elastic group grown or shrunk), relaunch "
                             "(the driver or job stopped and was started again), worker_exit "
                             "(a worker killed without a word).")


def recovery_time() -> timeseries.Panel:
    return panel("Time lost to restarts", "s",
                 query("max by (run) (ray_memtrain_train_recovery_seconds_total"
                       "{run=~\"$run\"}) or on () vector(0)", "{{run}}"),
                 description="Seconds from each failed attempt's last step to the next "
                             "attempt's first, summed over the run; the steps redone come on "
                             "top (each restart's log line counts them).")


def throughput_dashboard() -> dashboard.Dashboard:
    return assemble("Training throughput", "memtrain-throughput",
                    [tokens_per_second(), step_time(), data_wait_share(), checkpoint_time(),
                     loss(), grad_scale(), batch_split(), world_size(), restarts(),
                     recovery_time()])


DASHBOARDS = {"memtrain-memory.json": memory_dashboard,
              "memtrain-throughput.json": throughput_dashboard}


def render(name: str) -> str:
    """The JSON of one dashboard, deterministic: sorted keys, fixed indentation."""
    built = DASHBOARDS[name]().build()
    return json.dumps(json.loads(JSONEncoder(sort_keys=True).encode(built)), indent=2,
                      sort_keys=True) + "\n"


CONFIGMAP_PATH = Path(__file__).resolve().parents[1] / "k8s" / "monitoring" / \
    "grafana-dashboards.yaml"


def render_configmap() -> str:
    """A ConfigMap with every dashboard, labelled for kube-prometheus-stack's Grafana sidecar."""
    import yaml

    configmap = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "memtrain-grafana-dashboards",
                     "labels": {"grafana_dashboard": "1", "app.kubernetes.io/part-of": "memtrain"}},
        "data": {name: render(name) for name in sorted(DASHBOARDS)},
    }
    header = "# Generated by `make dashboards` from monitoring/dashboards.py; do not edit.\n"
    return header + yaml.safe_dump(configmap, sort_keys=True, width=100)


RULES_PATH = Path(__file__).resolve().parent / "prometheus" / "rules.yml"
PROMETHEUS_RULE_PATH = CONFIGMAP_PATH.parent / "prometheus-rule.yaml"


def render_prometheus_rule() -> str:
    """monitoring/prometheus/rules.yml as a Prometheus Operator ``PrometheusRule``, labelled
    for kube-prometheus-stack's default rule selector (``release: kube-prometheus-stack``)."""
    import yaml

    rule = {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
        "metadata": {"name": "memtrain-alerts",
                     "labels": {"release": "kube-prometheus-stack",
                                "app.kubernetes.io/part-of": "memtrain"}},
        "spec": {"groups": yaml.safe_load(RULES_PATH.read_text())["groups"]},
    }
    header = ("# Generated by `make dashboards` from monitoring/prometheus/rules.yml; do not "
              "edit.\n")
    return header + yaml.safe_dump(rule, sort_keys=True, width=100)


def write_dashboards(out_dir: Path = OUT_DIR, configmap: Path | None = CONFIGMAP_PATH
                     ) -> list[Path]:
    """Write every dashboard's JSON and (unless None) the Kubernetes ConfigMap holding them and
    the PrometheusRule holding the alert rules."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in DASHBOARDS:
        path = out_dir / name
        path.write_text(render(name))
        written.append(path)
    if configmap is not None:
        configmap.parent.mkdir(parents=True, exist_ok=True)
        configmap.write_text(render_configmap())
        written.append(configmap)
        rule = configmap.parent / PROMETHEUS_RULE_PATH.name
        rule.write_text(render_prometheus_rule())
        written.append(rule)
    return written
