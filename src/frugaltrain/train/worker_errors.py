"""How a worker's error reaches the user: one line from the launcher, with exit status 2 for bad
input and 1 for a failed run, and the whole traceback in the run directory
(RUN_DIR/worker_RANK.log), written by the worker itself."""

from __future__ import annotations

from pathlib import Path

from frugaltrain.config import ConfigError

BAD_INPUT_EXIT = 2  # a worker refused its input (ConfigError): restarting it would not help


class WorkerFailed(Exception):
    """A worker ended with an error: `str(e)` is one line for the user, `exit_code` is 2 for
    bad input and 1 for a failed run; the traceback is in the run directory's worker log."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def report_failure(run_dir: str | Path, rank: int, error: BaseException) -> int:
    """Write `error`'s traceback to RUN_DIR/worker_RANK.log and its one line beside it; the exit
    code of the worker: 2 for bad input (ConfigError), 1 otherwise."""
    import traceback

    run_dir = Path(run_dir)
    with open(run_dir / f"worker_{rank}.log", "a") as log:
        log.write("".join(traceback.format_exception(error)))
    line = str(error).splitlines()[0] if str(error) else type(error).__name__
    if not isinstance(error, ConfigError):
        line = f"{type(error).__name__}: {line}"
    (run_dir / f"worker_{rank}.error").write_text(line)
    return BAD_INPUT_EXIT if isinstance(error, ConfigError) else 1


def failure_of(run_dir: str | Path, rank: int, exit_code: int) -> WorkerFailed:
    """The WorkerFailed of a worker process that exited with `exit_code`."""
    error = Path(run_dir) / f"worker_{rank}.error"
    what = error.read_text() if error.is_file() else f"exited with code {exit_code}"
    log = Path(run_dir) / f"worker_{rank}.log"
    where = f" (traceback in {log})" if log.is_file() else " (see its output above)"
    return WorkerFailed(f"worker {rank}: {what}{where}", 2 if exit_code == BAD_INPUT_EXIT else 1)
