"""Print the Qualcomm toolchain's package versions as one JSON object (run inside the env)."""

import json
import os
import sys
from importlib import metadata

PACKAGES = ("onnxruntime-qnn", "onnxruntime", "onnx", "numpy")


def main() -> None:
    # QAIRT's libraries greet on standard output, even at exit: the JSON goes out on a
    # copy of it, and everything else to stderr.
    result = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:
        from onnxruntime_qnn import build_and_package_info

        # The QAIRT release whose host libraries the wheel ships.
        versions["qairt"] = build_and_package_info.qnn_version
    except ImportError:
        versions["qairt"] = None
    try:
        import ctypes

        from onnxruntime_qnn import get_qnn_htp_path

        # The EP loads its QAIRT libraries only when a session starts: a missing system
        # library (libatomic.so.1 in a bare image) must fail here, when the env is made.
        folder = os.path.dirname(get_qnn_htp_path())
        for name in ("libQnnHtp.so", "libQnnSystem.so", "libHtpPrepare.so"):
            ctypes.CDLL(os.path.join(folder, name))
    except ImportError:
        pass
    except OSError as err:
        sys.exit(f"error: QAIRT's HTP backend library does not load: {err}")
    print(json.dumps(versions, sort_keys=True), file=result, flush=True)


if __name__ == "__main__":
    main()
