"""Build the CPU variant of docker/Dockerfile with podman and run it for real (`make image-check`).

What it does, each step timed, on this machine's own loopback and nothing else:
1. the base image: Debian 12 from Debian's packages (debootstrap; no registry is needed);
2. the build, with the locked packages (torch's CPU build from TORCH_FIND_LINKS);
3. the layers and their sizes, and how much a code-only change pushes: a second build from a
   copy of the context with one comment changed in trainer/, counting the layers it adds;
4. the demo config trained inside the image as uid 1000, its run directory bind-mounted from
   the host; then as another uid (a host user that is not 1000, as `make local` runs it);
5. the memory strategies' packages and compiler in the image: the demo model with LoRA adapters
   and 8-bit AdamW states (peft, torchao, and torch.compile's C++ kernels for torchao's step),
   one local worker; its checkpoint must hold the adapters' moments in 8 bits; and QLoRA (the
   blocks' linear weights in NF4 under the adapters, bf16), its log naming every NF4 layer;
6. a Ray head in one container (token auth on, network namespace of its own: only loopback),
   the image's HEALTHCHECK run against it, and `memtrain submit` from a second container in
   that namespace, submitted twice with one run name: the second resumes from the first's
   checkpoint.
Figures go to OUT/image-check.json and .md. Exit 1 at the first step that fails, naming it.

Podman on this kind of machine needs runc, the cgroupfs manager and explicit ulimits
(../shared/CONTAINERS.md); a TLS-inspecting proxy's CA bundle is mounted for pip (BUILD_CA_CERT).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager=cgroupfs"]
LIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
BASE = "localhost/debian:bookworm"
CONTEXT = ["docker/requirements", "docker/memtrain", "trainer", "datapipe", "monitoring",
           "configs", ".dockerignore"]
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
DEMO = ["--config", "configs/demo-cpu.yaml", "--set", "run.dir=/runs",
        "--set", "data.path=/data/stdlib/train", "--set", "data.val_path=/data/stdlib/val"]
# Rank 32 makes every adapter 4,096 values or more, the least torchao quantizes (smaller tensors
# keep fp32 moments): with rank 4 no moment would be 8-bit.
LORA_8BIT = ["--set", "model.lora.rank=32", "--set", "memory.optimizer_states=8bit",
             "--set", "parallel.launcher=local", "--set", "parallel.workers=1"]
LORA_STEPS = 4
QLORA = ["--set", "model.lora.rank=8", "--set", "model.lora.base_dtype=nf4",
         "--set", "memory.precision=bf16", "--set", "parallel.launcher=local",
         "--set", "parallel.workers=1"]


class CheckFailed(RuntimeError):
    pass


def podman(*args: str, check: bool = True,
           timeout: float = 1200) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-15:])
        raise CheckFailed(f"podman {' '.join(args[:3])} ... failed ({out.returncode}):\n{tail}")
    return out


def timed(figures: dict[str, Any], name: str, fn: Any, *args: Any) -> Any:
    start = time.perf_counter()
    result = fn(*args)
    figures[f"{name}_seconds"] = round(time.perf_counter() - start, 1)
    print(f"image-check: {name}: {figures[f'{name}_seconds']} s", flush=True)
    return result


def ensure_base() -> None:
    if podman("image", "exists", BASE, check=False).returncode == 0:
        return
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        raise CheckFailed(f"no {BASE} image, and making one needs root and debootstrap "
                          "(apt-get install debootstrap)")
    with tempfile.TemporaryDirectory() as root:
        subprocess.run(["debootstrap", "--variant=minbase", "bookworm", root],
                       check=True, capture_output=True)
        tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
        subprocess.run([*PODMAN, "import", "-", BASE], stdin=tar.stdout, check=True,
                       capture_output=True)
        tar.wait()


def build(context: Path, tag: str, revision: str, find_links: str) -> None:
    mounts = []
    if Path(find_links).is_dir():  # a local folder of wheels: mount it where the build sees it
        mounts, find_links = ["-v", f"{find_links}:/wheels:ro"], "/wheels"
    ca = ["-v", f"{HOST_CA}:/run/host-ca.crt:ro", "--build-arg",
          "BUILD_CA_CERT=/run/host-ca.crt"] if HOST_CA.is_file() else []
    podman("build", "--format", "docker", "--network", "host", *LIMITS, *mounts, *ca,
           "--build-arg", f"BASE={BASE}", "--build-arg", "VARIANT=cpu",
           "--build-arg", f"TORCH_FIND_LINKS={find_links}", "--build-arg", f"VERSION={version()}",
           "--build-arg", f"REVISION={revision}", "-f", str(REPO / "docker/Dockerfile"),
           "-t", tag, str(context))


def layers(tag: str) -> list[tuple[str, int, str]]:
    """(diff id, bytes, instruction) of each filesystem layer, bottom first."""
    ids = json.loads(podman("inspect", tag, "--format", "{{json .RootFS.Layers}}").stdout)
    history = json.loads(podman("history", "--format", "json", tag).stdout)[::-1]
    steps = [(h["size"], h["CreatedBy"]) for h in history
             if "#(nop)" not in h["CreatedBy"] or "#(nop) COPY" in h["CreatedBy"]
             or "#(nop) ADD" in h["CreatedBy"]]
    if len(steps) != len(ids):
        raise CheckFailed(f"{tag}: {len(ids)} layers but {len(steps)} layer steps in history")
    return [(i, size, _instruction(cmd)) for i, (size, cmd) in zip(ids, steps, strict=True)]


def _instruction(created_by: str) -> str:
    """History's text of a step, shortened to its Dockerfile instruction."""
    text = created_by.replace("/bin/sh -c #(nop) ", "")
    if "/bin/sh -c " in text:  # a RUN, after its build arguments
        text = "RUN " + text.split("/bin/sh -c ", 1)[1]
    return " ".join(text.split())[:60]


def code_change_push(tag: str, revision: str, find_links: str) -> tuple[int, int]:
    """Bytes and count of the layers that a one-comment change in trainer/ adds."""
    with tempfile.TemporaryDirectory() as tmp:
        context = Path(tmp)
        for item in CONTEXT:
            source, target = REPO / item, context / item
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(source, target)
        init = context / "trainer" / "__init__.py"
        init.write_text(init.read_text() + "# image-check: a code-only change\n")
        build(context, f"{tag}-codechange", revision, find_links)
    old = {layer[0] for layer in layers(tag)}
    new = [layer for layer in layers(f"{tag}-codechange") if layer[0] not in old]
    podman("rmi", f"{tag}-codechange", check=False)
    return sum(size for _, size, _ in new), len(new)


def run_demo(tag: str, runs: Path, uid: int, steps: int, *settings: str) -> dict[str, Any]:
    """The demo config, with ``settings`` on top, inside the image as ``uid``; returns its
    summary.json, with the run's log as ``log``. Raises CheckFailed unless it finished
    ``steps`` steps."""
    runs.mkdir(parents=True, exist_ok=True)
    os.chown(runs, uid, uid)  # what `make local` does for a host user that is root
    out = podman("run", "--rm", "--network", "none", *LIMITS, "--shm-size", "1g",
           "--user", f"{uid}:{uid}", "-e", "HOME=/tmp",
           "-v", f"{REPO / 'data'}:/data:ro", "-v", f"{runs}:/runs",
           tag, "memtrain", "train", *DEMO, "--run-name", "demo",
           "--set", f"train.steps={steps}", "--set", "train.eval_every=0", *settings,
           timeout=900)
    summary = json.loads((runs / "demo" / "summary.json").read_text())
    if summary["final_step"] != steps:
        raise CheckFailed(f"the run stopped at step {summary['final_step']} of {steps}")
    owners = {p.stat().st_uid for p in (runs / "demo").rglob("*")}
    if owners != {uid}:
        raise CheckFailed(f"files of the run as uid {uid} are owned by {owners}")
    return {**summary, "log": out.stdout + out.stderr}


def run_qlora(tag: str, runs: Path) -> dict[str, Any]:
    """QLoRA inside the image: the demo model's blocks' linear weights in NF4 (torchao's) under
    LoRA adapters, bf16, one local worker; returns its figures. Raises CheckFailed unless it
    finished and its log says every linear layer of the blocks (16 at the demo's width) was
    quantized."""
    summary = run_demo(tag, runs, 1000, LORA_STEPS, *QLORA)
    said = [line for line in summary["log"].splitlines() if "NF4 base: " in line]
    if not said or "NF4 base: 16 linear layers" not in said[0]:
        raise CheckFailed(f"the QLoRA run's log does not say 16 NF4 layers: {said[:1]}")
    return {"qlora_steps": summary["final_step"],
            "qlora_loss": f"{summary['first_loss']:.3f} -> {summary['final_loss']:.3f}",
            "qlora_log": said[0].split("NF4 base: ", 1)[1][:160]}


def run_lora_8bit(tag: str, runs: Path) -> dict[str, Any]:
    """LoRA with 8-bit AdamW states inside the image; returns its figures. Raises CheckFailed
    unless it finished and its checkpoint holds every adapter's moments in 8 bits."""
    summary = run_demo(tag, runs, 1000, LORA_STEPS, *LORA_8BIT)
    ratio = adapter_moment_ratio(runs / "demo" / f"checkpoint-{LORA_STEPS:08d}")
    # 8 bits: a byte a value and a scale per 256 values, about 0.4 of the fp32 weight with the
    # checkpoint's per-tensor overhead at 4,096 values; fp32 moments: 1.0
    if ratio > 0.5:
        raise CheckFailed(f"an adapter's AdamW moment takes {ratio:.2f} of its weight's bytes "
                          "in the checkpoint: not 8-bit states")
    return {"lora_8bit_steps": summary["final_step"],
            "lora_8bit_loss": f"{summary['first_loss']:.3f} -> {summary['final_loss']:.3f}",
            "lora_8bit_moment_to_weight_bytes": round(ratio, 2)}


def adapter_moment_ratio(checkpoint: Path) -> float:
    """The largest ratio, over a LoRA checkpoint's adapters, of the bytes stored for one AdamW
    moment (``exp_avg``) to those of the adapter's weight."""
    from torch.distributed.checkpoint import FileSystemReader  # about 2 s: only this step

    stored: dict[str, int] = {}
    for index, info in FileSystemReader(str(checkpoint)).read_metadata().storage_data.items():
        stored[index.fqn] = stored.get(index.fqn, 0) + info.length
    adapters = [name for name in stored if name.startswith("model.") and ".lora_" in name]
    if not adapters:
        raise CheckFailed(f"{checkpoint} holds no LoRA adapters")
    return max(stored[f"optimizer.state.{name.removeprefix('model.')}.exp_avg"] / stored[name]
               for name in adapters)


def head_and_submit(tag: str, runs: Path) -> dict[str, Any]:
    runs.mkdir(parents=True, exist_ok=True)
    os.chown(runs, 1000, 1000)
    token = secrets.token_urlsafe(24)
    name = f"memtrain-check-head-{os.getpid()}"
    podman("run", "-d", "--network", "none", *LIMITS, "--shm-size", "1g", "--name", name,
           "-e", "RAY_AUTH_MODE=token", "-e", f"RAY_AUTH_TOKEN={token}",
           "-v", f"{REPO / 'data'}:/data:ro", "-v", f"{runs}:/runs", tag,
           "ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
           "--dashboard-host=127.0.0.1", "--num-cpus=2")
    figures: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + 120
        while podman("healthcheck", "run", name, check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise CheckFailed("the head's HEALTHCHECK never passed: "
                                  + podman("logs", name, check=False).stderr[-2000:])
            time.sleep(2)
        figures["healthcheck"] = "passed"
        submit = ["run", "--rm", "--network", f"container:{name}", *LIMITS,
                  "-e", f"RAY_AUTH_TOKEN={token}", tag, "memtrain", "submit", "--address",
                  "http://127.0.0.1:8265", *DEMO, "--run-name", "submitted", "--no-ship-code",
                  "--set", "train.eval_every=0", "--set", "train.checkpoint_every=4"]
        for steps in (4, 8):
            out = podman(*submit, "--set", f"train.steps={steps}", timeout=600)
            if "SUCCEEDED" not in out.stdout:
                raise CheckFailed(f"submit: {out.stdout[-1500:]}")
        summary = json.loads((runs / "submitted" / "summary.json").read_text())
        if (summary["resumed_from_step"], summary["final_step"]) != (4, 8):
            raise CheckFailed(f"the resubmitted run did not resume at step 4: {summary}")
        figures["resubmitted_run"] = "resumed from step 4, finished at 8"
    finally:
        podman("rm", "-f", name, check=False)
    return figures


def version() -> str:
    return str(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"])


def revision() -> str:
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
                         capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain",
                            "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
    return (out.stdout.strip() or "unknown") + ("-dirty" if dirty else "")


def write(out: Path, figures: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "image-check.json").write_text(json.dumps(figures, indent=2) + "\n")
    mib = 2**20
    lines = [f"# image-check ({figures['tag']})", "", f"machine: {figures['machine']}", "",
             "| step | figure |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in figures.items()
              if k not in ("layers", "tag", "machine")]
    lines += ["", "| layer | MiB |", "|---|---|"]
    lines += [f"| `{cmd}` | {size / mib:.2f} |" for _, size, cmd in figures["layers"]]
    (out / "image-check.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--torch-find-links", default=os.environ.get(
        "TORCH_FIND_LINKS", "https://download.pytorch.org/whl/cpu/torch/"))
    parser.add_argument("--steps", type=int, default=20, help="demo steps inside the image")
    parser.add_argument("--keep", action="store_true", help="keep the image")
    args = parser.parse_args()
    if shutil.which("podman") is None:
        raise SystemExit("image-check: podman not found (apt-get install podman runc debootstrap)")
    if not (REPO / "data/stdlib/train/manifest.json").is_file():
        raise SystemExit("image-check: no demo data: run make data first")
    rev = revision()
    tag = f"localhost/memtrain:{version()}-{rev}-cpu"
    figures: dict[str, Any] = {"tag": tag, "machine": machine()}
    work = Path(tempfile.mkdtemp(prefix="memtrain-image-check-"))
    try:
        timed(figures, "base_image", ensure_base)
        timed(figures, "build", build, REPO, tag, rev, args.torch_find_links)
        figures["layers"] = layers(tag)
        figures["image_mib"] = round(sum(s for _, s, _ in figures["layers"]) / 2**20, 1)
        pushed, count = timed(figures, "code_change_build", code_change_push, tag, rev,
                              args.torch_find_links)
        figures["code_change_push_kib"] = round(pushed / 1024, 1)
        figures["code_change_layers"] = count
        summary = timed(figures, "demo_uid_1000", run_demo, tag, work / "runs-1000", 1000,
                        args.steps)
        figures["demo_tokens_per_second"] = round(summary["tokens_per_second"])
        figures["demo_steps"] = summary["final_step"]
        timed(figures, "demo_uid_4242", run_demo, tag, work / "runs-4242", 4242, 4)
        figures.update(timed(figures, "lora_8bit", run_lora_8bit, tag, work / "runs-lora"))
        figures.update(timed(figures, "qlora", run_qlora, tag, work / "runs-qlora"))
        figures.update(timed(figures, "head_submit_resubmit", head_and_submit, tag,
                             work / "runs-submit"))
    except CheckFailed as err:
        print(f"image-check: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not args.keep:
            podman("rmi", tag, check=False)
    write(args.out, figures)
    print(f"image-check: passed; figures in {args.out}/image-check.md")


def machine() -> str:
    from monitoring.host import cpu_info

    version = podman("--version").stdout.split()[-1]
    return f"{cpu_info().describe()}, {os.cpu_count()} CPUs, podman {version}"


if __name__ == "__main__":
    main()
