"""Every private or experimental API in trainer/compat.py, called for real on the pinned
versions: when torch or Ray moves one, this fails with a line naming the installed version."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO
from trainer import compat

pytestmark = pytest.mark.unit


def _moved(what: str, err: BaseException) -> str:
    return f"{what} moved in torch {torch.__version__}: {type(err).__name__}: {err}"


def test_cpu_bf16_support_reads_the_cpu() -> None:
    try:
        kind = compat.cpu_bf16_support()
        capability = compat.cpu_capability()
    except (AttributeError, RuntimeError) as err:
        pytest.fail(_moved("torch.cpu._is_avx512_bf16_supported / mkldnn bf16 check", err))
    assert kind in ("native", "onednn-emulated", "emulated")
    assert capability in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "NO AVX", "VSX", "SVE256")
    if kind == "native":  # oneDNN takes bf16 on every CPU with the native instructions
        assert torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("cpu, max_isa, kind", [
    ("native", None, "native"),
    ("native", "AVX512_CORE_AMX", "native"),
    ("native", "AVX512_CORE_BF16", "native"),
    ("native", "AVX512_CORE", "onednn-emulated"),  # the cap that emulates on a native CPU
    ("native", "AVX512_CORE_VNNI", "onednn-emulated"),
    ("native", "AVX2", "emulated"),
    ("avx512", None, "onednn-emulated"),
    ("avx512", "AVX512_CORE_AMX", "onednn-emulated"),  # a cap never adds instructions
    ("avx512", "AVX2_VNNI", "emulated"),
    ("avx2", None, "emulated"),
    ("avx2", "AVX512_CORE_BF16", "emulated"),
])
def test_the_bf16_kind_follows_the_cpu_under_onednns_cap(cpu: str, max_isa: str | None,
                                                         kind: str) -> None:
    assert compat.bf16_kind(cpu == "native", cpu in ("native", "avx512"), max_isa) == kind


@pytest.mark.parametrize("environ, max_isa", [
    ({}, None),
    ({"ONEDNN_MAX_CPU_ISA": "avx512_core"}, "AVX512_CORE"),  # oneDNN upper-cases the value
    ({"DNNL_MAX_CPU_ISA": "AVX2"}, "AVX2"),  # the older name
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "DNNL_MAX_CPU_ISA": "AVX2"}, "AVX512_CORE"),
    ({"ONEDNN_MAX_CPU_ISA": "ALL"}, None),
    ({"ONEDNN_MAX_CPU_ISA": "DEFAULT"}, None),
    ({"ONEDNN_MAX_CPU_ISA": "PENTIUM"}, None),  # unknown: oneDNN ignores it too
])
def test_onednns_cap_is_read_from_the_environment(environ: dict[str, str],
                                                  max_isa: str | None) -> None:
    assert compat.onednn_max_cpu_isa(environ) == max_isa


def test_a_cap_below_avx512_leaves_this_cpu_no_onednn_bf16() -> None:
    """No stub: this machine's own CPU, with and without a cap."""
    assert compat.cpu_bf16_support({"ONEDNN_MAX_CPU_ISA": "AVX2"}) == "emulated"
    assert compat.cpu_bf16_support({}) in ("native", "onednn-emulated", "emulated")


def test_checkpoint_wrapper_is_recognised() -> None:
    block = torch.nn.Linear(4, 4)
    try:
        api = compat.checkpoint_wrapper_api()
        wrapped = api.checkpoint_wrapper(block, checkpoint_impl=api.CheckpointImpl.NO_REENTRANT)
    except (ImportError, AttributeError, TypeError) as err:
        pytest.fail(_moved("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", err))
    assert compat.is_checkpoint_wrapper(wrapped) and not compat.is_checkpoint_wrapper(block)
    assert "check_fn" in inspect.signature(api.apply_activation_checkpointing).parameters


def test_cpu_allocation_events_record_a_known_allocation() -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = torch.empty(1 << 20, dtype=torch.uint8)
    try:
        events = compat.cpu_allocation_events(prof)
    except (AttributeError, RuntimeError) as err:
        pytest.fail(_moved("the profiler's experimental_event_tree / _EventType", err))
    assert any(size == kept.untyped_storage().nbytes() for _t, size, _total in events)
    assert [t for t, _s, _total in events] == sorted(t for t, _s, _total in events)


def test_allocator_settings_answers_without_cuda() -> None:
    assert isinstance(compat.allocator_settings(), str)


def test_cuda_memory_history_functions_exist() -> None:
    # Recording needs CUDA; the private functions they call must still be there.
    for name in ("_record_memory_history", "_dump_snapshot"):
        assert callable(getattr(torch.cuda.memory, name, None)), \
            f"torch.cuda.memory.{name} is gone in torch {torch.__version__}"


def test_ray_init_accepts_the_private_keywords() -> None:
    import importlib.metadata

    version = importlib.metadata.version("ray")
    import ray  # the signature only: nothing starts

    # ray.init pops its private keywords out of **kwargs by name and refuses unknown ones.
    source = inspect.getsource(ray.init)
    kwargs = compat.ray_loopback_init_kwargs("127.0.0.1", 9999)
    missing = [key for key in kwargs if f'"{key}"' not in source]
    assert not missing, f"ray.init lost {missing} in Ray {version}"


def test_the_jobs_client_keeps_the_cluster_version() -> None:
    import importlib.metadata

    from ray.job_submission import JobSubmissionClient

    version = importlib.metadata.version("ray")
    client = object.__new__(JobSubmissionClient)  # no cluster: the attribute is set in __init__
    source = inspect.getsource(JobSubmissionClient)
    assert "self._server_ray_version" in source, \
        f"JobSubmissionClient no longer keeps _server_ray_version in Ray {version}"
    client._server_ray_version = version
    assert compat.ray_server_version(client) == version


def test_ray_metrics_export_interval_is_readable() -> None:
    import importlib.metadata

    import ray._private.telemetry.open_telemetry_metric_recorder as recorder

    version = importlib.metadata.version("ray")
    # Ray's default, read in a fresh interpreter: in a test process whose Ray session set
    # another interval (the session cluster's 1 s), the config reads that one.
    read = subprocess.run([sys.executable, "-c", "from trainer import compat; "
                           "print(compat.ray_metrics_export_seconds())"],
                          capture_output=True, text=True, check=True, cwd=REPO)
    assert float(read.stdout) == 10.0, f"Ray {version}'s default moved"
    # The agent's gauge expiry that memtrain's publisher stays inside: two export intervals.
    source = inspect.getsource(recorder.OpenTelemetryMetricRecorder._resolve_gauge_ttl_seconds)
    assert "2 * effective_report_interval_ms" in source, \
        f"Ray {version} changed how long its agent keeps a gauge"


def test_ray_generates_the_dashboards_its_web_ui_embeds() -> None:
    import importlib.metadata
    import json

    version = importlib.metadata.version("ray")
    made = compat.ray_grafana_dashboards()
    assert set(made) == {"rayDefaultDashboard", "rayTrainDashboard"}, \
        f"Ray {version}'s dashboard uids moved"
    for uid, content in made.items():
        dashboard = json.loads(content)
        assert dashboard["uid"] == uid and dashboard["panels"], uid
        # Ray's panels ask for a Prometheus datasource by a variable: any name works.
        assert dashboard["templating"]["list"][0]["name"] == "datasource", uid


def test_compat_imports_neither_torch_nor_ray() -> None:
    """``memtrain submit`` runs where torch is absent: compat may not need it to import."""
    import subprocess
    import sys

    code = "import sys, trainer.compat; print('torch' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["False", "False"]


def test_op_workspace_counts_what_an_op_frees_not_its_output() -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    def op() -> torch.Tensor:
        with record_function("memtrain::op"):
            output = torch.empty(1 << 16, dtype=torch.uint8)
            scratch = torch.empty(1 << 18, dtype=torch.uint8)  # a kernel's own buffer
            del scratch
        return output

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = op()
    try:
        workspace = compat.cpu_op_workspace_bytes(prof, frozenset({"memtrain::op"}))
    except (AttributeError, RuntimeError) as err:
        pytest.fail(_moved("the profiler's experimental_event_tree / _EventType", err))
    assert workspace == 1 << 18 and kept.numel() == 1 << 16
    assert compat.cpu_op_workspace_bytes(prof, frozenset({"aten::nothing"})) == 0


_PROFILED_WITH_STDERR = """
import logging, sys, torch
from trainer.telemetry.diagnostics import cpu_peak_bytes
if sys.argv[1] == "debug":
    logging.basicConfig(level=logging.DEBUG, format="%(name)s %(message)s")
def noisy():
    torch.ones(1000) + 1
    sys.stderr.write("a line of the program's own\\n")
print(cpu_peak_bytes(noisy) > 0)
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["quiet", "debug"])
def test_the_profilers_native_log_lines_are_held_back(mode: str) -> None:
    """torch's profiler logs ``USDT:... profiler_start`` to stderr from C++ at every window:
    held back (to the log at DEBUG), while the block's other stderr output comes through."""
    out = subprocess.run([sys.executable, "-c", _PROFILED_WITH_STDERR, mode],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr
    assert "a line of the program's own" in out.stderr
    if mode == "quiet":
        assert "profiler_start" not in out.stderr, out.stderr
    else:  # the logger at DEBUG shows them, as `memtrain --debug` would
        assert "profiler_start" in out.stderr, out.stderr


def test_ray_trains_torch_backend_is_what_memtrain_subclasses() -> None:
    """``on_start`` makes the group with torch's ``env://`` store (memtrain's backend replaces
    it), and the helpers it calls keep their signatures."""
    import inspect as inspect_

    from trainer.compat import ray_torch_backend

    backend, set_env, address_and_port, v1_group = ray_torch_backend()
    source = inspect_.getsource(backend.on_start)
    assert "get_address_and_port" in source and "_set_torch_distributed_env_vars" in source
    assert "_setup_torch_process_group" in source
    assert "if not isinstance(worker_group, V1WorkerGroup):" in source
    assert v1_group.__name__ == "WorkerGroup"
    assert list(inspect_.signature(set_env).parameters) == []
    assert list(inspect_.signature(address_and_port).parameters) == []


@pytest.mark.slow
def test_transformers_names_checkpoint_tensors_as_memtrain_reads_them() -> None:
    """The renames ``from_pretrained`` applies (GPT-NeoX's ``embed_out`` is ``lm_head``) and
    the base model's prefix added to a file saved from the base model (GPT-2's ``h.0``)."""
    import transformers

    from trainer.compat import hf_checkpoint_renamer

    neox = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2))
    rename = hf_checkpoint_renamer(neox, set(neox.state_dict()))
    assert rename("embed_out.weight") == ("lm_head.weight", None)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8))
    rename = hf_checkpoint_renamer(gpt2, set(gpt2.state_dict()))
    assert rename("h.0.attn.c_attn.weight") == ("transformer.h.0.attn.c_attn.weight", None)


def test_a_module_already_in_place_is_kept_on_fake_tensors() -> None:
    """Under fake tensors torch swaps parameters even for a move that changes nothing, and
    cannot; ``modules_kept_in_place`` returns such a module untouched."""
    import torch

    from trainer.compat import fake_tensor_mode, modules_kept_in_place

    with fake_tensor_mode():
        layer = torch.nn.Linear(4, 4)
        with pytest.raises(RuntimeError, match="Couldn't swap"):
            layer.to("cpu")
        with modules_kept_in_place():
            assert layer.to("cpu") is layer and layer.to(torch.float32) is layer
