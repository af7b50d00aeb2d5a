"""Print the TPU-MLIR toolchain's versions as one JSON object (run inside the env)."""

import json
import platform
from importlib import metadata

PACKAGES = ("tpu_mlir", "torch", "onnx", "onnxruntime", "numpy")


def main() -> None:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    print(json.dumps(versions, sort_keys=True))


if __name__ == "__main__":
    main()
