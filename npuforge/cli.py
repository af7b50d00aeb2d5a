"""Shared plumbing for the step CLIs in workflow_scripts/."""

import errno
import os
import sys

from npuforge.errors import NpuforgeError

# What the machine refused, by errno: the fix to name in the one-line error.
OS_FIXES = {
    errno.ENOSPC: "free disk space or point results= at a larger filesystem",
    errno.EDQUOT: "free disk space (quota) or point results= elsewhere",
    errno.EFBIG: "raise the file size limit (ulimit -f) or point results= elsewhere",
    errno.EROFS: "point results= at a writable filesystem",
    errno.EACCES: "fix the permissions or point results= elsewhere",
    errno.EPERM: "fix the permissions or point results= elsewhere",
}


# The workflow's shell prefix opens this descriptor on the terminal's stderr before the
# rule sends the step's output to its log: a failed step's line then reaches the user
# first, ahead of Snakemake's report of the failed job.
ERROR_FD = "NPUFORGE_ERROR_FD"


def fail(message: str) -> int:
    """Say ``message`` on stderr (the step's log) and on the terminal; return exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.stderr.flush()
    fd = os.environ.get(ERROR_FD, "")
    if fd.isdigit():
        try:
            os.write(int(fd), f"npuforge: {message}\n".encode(errors="replace"))
        except OSError:
            pass  # not opened (a step run by hand): the log has the line
    return 2


def _os_refusal(err: BaseException) -> OSError | None:
    """The OSError with a known fix in ``err`` or the exceptions it was raised from."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in OS_FIXES:
            return err
        err = err.__cause__ or err.__context__
    return None


class Stopped(BaseException):
    """The step received SIGTERM (Snakemake stopping its jobs, a cluster's time limit)."""


def _stopped(signum, frame):
    raise Stopped()


def run_cli(main, argv=None) -> int:
    """Run ``main(argv)``; turn an NpuforgeError, an operating-system refusal (disk full,
    file size limit, read-only filesystem) or running out of memory into one line on
    stderr and exit 2. Outputs are written atomically, so nothing partial is left; a
    SIGTERM unwinds the step the same way (its toolchain job stopped, its temporary
    outputs removed) and exits 143."""
    import signal
    import threading

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _stopped)
    try:
        return _run_main(main, argv)
    except Stopped:
        fail("stopped by SIGTERM; nothing of this step was kept")
        return 128 + signal.SIGTERM
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run_main(main, argv) -> int:
    try:
        main(argv)
    except NpuforgeError as err:
        return fail(str(err))
    except MemoryError:
        return fail(
            "out of memory; give the job more memory (targets.yaml compile_mem_mb for "
            "compile jobs, a larger machine, or fewer parallel jobs with --cores)"
        )
    except Exception as err:
        # A library may wrap the refusal (torch.save raises RuntimeError after ENOSPC).
        refused = _os_refusal(err)
        if refused is None:
            raise
        where = f"{refused.filename}: " if refused.filename else ""
        return fail(f"{where}{refused.strerror}; {OS_FIXES[refused.errno]}")
    return 0


def compile_argument_parser(description: str):
    """The arguments of workflow_scripts/compile.py (docs/interfaces.md)."""
    import argparse

    from npuforge.backends.base import WEIGHTS

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--backend", required=True, help="onnx, qnn, rknn or tpumlir")
    parser.add_argument(
        "--export", action="append", required=True, help="export directory; repeatable"
    )
    parser.add_argument(
        "--calibration",
        action="append",
        default=[],
        help="calibration directory of one --export (quantized precisions); repeatable, "
        "paired with the exports by the variant its calibration.json records",
    )
    parser.add_argument("--target", required=True, help="target id from targets.yaml")
    parser.add_argument(
        "--target-options", default="{}", help="the target's options from targets.yaml as JSON"
    )
    parser.add_argument("--precision", required=True)
    parser.add_argument("--toolchain", help="toolchain stamp JSON (prepare_toolchain.py)")
    parser.add_argument("--heldout", help="the model's held-out token file (verification text)")
    parser.add_argument("--checkpoint", help="the fetched checkpoint (the onnx reference target)")
    parser.add_argument(
        "--state", action="append", default=[], help="RWKV state file shipped beside (tpumlir)"
    )
    parser.add_argument(
        "--weights",
        choices=WEIGHTS,
        default="trained",
        help="the checkpoint's weights: trained, or synthetic (random); chooses the floors",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU cores the step may use (tpumlir: nets compiled side by side); "
        "the bytes do not depend on it",
    )
    parser.add_argument("--out-dir", required=True, help="directory to write")
    parser.add_argument("--log", help="append the toolchain job's output here")
    return parser


def target_options(args) -> dict:
    """``--target-options`` as a dict, or a one-line error."""
    import json

    try:
        options = json.loads(args.target_options)
    except json.JSONDecodeError as err:
        raise NpuforgeError(
            f"--target-options is not JSON ({err.msg}); pass a JSON object"
        ) from None
    if not isinstance(options, dict):
        raise NpuforgeError("--target-options must be a JSON object")
    return options
