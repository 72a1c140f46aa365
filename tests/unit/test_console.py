"""The driver's console under Ray: workers' tracebacks dropped, their own lines kept
(``trainer/launch/console.py``), through Ray's own dispatcher of forwarded output."""

from __future__ import annotations

from typing import Any

from trainer.launch.console import TracebackFilter

FAILED = [
    "step    20/150 | loss 3.1278 |    31204 tok/s | peak 504.3 MiB | data wait  0.3% | left 2m10s",
    "Traceback (most recent call last):",
    '  File "/work/main/trainer/launch/ray.py", line 200, in _worker_loop',
    "    train(cfg, ctx)",
    "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer.",
    "",
    "The above exception was the direct cause of the following exception:",
    "",
    "Traceback (most recent call last):",
    '  File "ray/_private/worker.py", line 1055, in get_objects',
    "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.",
    "\tclass_name: RayTrainWorker",
    "\tpid: 20577",
    "restarted after a worker exited without an error of its own: resumed from step 18 "
    "(8.1 s, 3 steps redone)",
]


def test_tracebacks_are_dropped_and_the_workers_own_lines_kept() -> None:
    keep = TracebackFilter()
    out = keep({"pid": 7, "lines": FAILED, "is_err": True})
    assert out["lines"] == [FAILED[0], FAILED[-1]]
    assert out["pid"] == 7 and out["is_err"]


def test_a_traceback_split_over_batches_and_processes_is_dropped_whole() -> None:
    keep = TracebackFilter()
    first = keep({"pid": 1, "lines": FAILED[:3]})
    other = keep({"pid": 2, "lines": ["step     4 | loss 4.0"]})  # another worker meanwhile
    rest = keep({"pid": 1, "lines": FAILED[3:]})
    assert first["lines"] == [FAILED[0]]
    assert other["lines"] == ["step     4 | loss 4.0"]
    assert rest["lines"] == [FAILED[-1]]


def test_rays_dispatcher_takes_the_filter_in_front_of_its_printer() -> None:
    """The private dispatcher ray.init registers its printer with (trainer.compat): the
    filter goes in front of it, once, and an emptied batch is not printed at all."""
    from ray._private import ray_logging

    from trainer.compat import ray_worker_output_filter

    printed: list[dict[str, Any]] = []
    dispatcher = ray_logging.global_worker_stdstream_dispatcher
    # This process's own handlers (a driver of the session's cluster has Ray's printer) stand
    # aside: only a stand-in printer takes the test's batches.
    with dispatcher._lock:
        theirs, dispatcher.handlers = dispatcher.handlers, [("ray_print_logs", printed.append)]
    try:
        ray_worker_output_filter(TracebackFilter())
        ray_worker_output_filter(TracebackFilter())  # twice: still one filter
        dispatcher.emit({"pid": 3, "lines": FAILED[1:5]})
        dispatcher.emit({"pid": 3, "lines": ["step 5"]})
    finally:
        with dispatcher._lock:
            dispatcher.handlers = theirs
    assert printed == [{"pid": 3, "lines": ["step 5"]}]
