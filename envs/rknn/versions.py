"""Print the RKNN toolchain's package versions as one JSON object (run inside the env)."""

import json
from importlib import metadata

PACKAGES = ("rknn-toolkit2", "onnx", "onnxruntime", "numpy", "torch", "protobuf", "setuptools")


def main() -> None:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    print(json.dumps(versions, sort_keys=True))


if __name__ == "__main__":
    main()
