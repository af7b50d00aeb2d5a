"""Print the Qualcomm toolchain's package versions as one JSON object (run inside the env)."""

import json
from importlib import metadata

PACKAGES = ("onnxruntime-qnn", "onnxruntime", "onnx", "numpy")


def main() -> None:
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
    print(json.dumps(versions, sort_keys=True))


if __name__ == "__main__":
    main()
