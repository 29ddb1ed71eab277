"""Package layout: kernels/ and eval/ are top-level folders installed as cotserve.kernels and
cotserve.eval (a top-level `kernels` module would collide with the package transformers probes for).
Everything else is metadata in pyproject.toml."""

from setuptools import find_packages, setup

MAPPED = {"cotserve.kernels": "kernels", "cotserve.eval": "eval", "cotserve.steering_vectors": "steering_vectors"}

packages = find_packages(include=["cotserve", "cotserve.*"])
package_dir = {"cotserve": "cotserve", **MAPPED}
for name, folder in MAPPED.items():
    packages.append(name)
    for sub in find_packages(folder):
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={
        "cotserve": ["py.typed", "calibration/*.json"],
        "cotserve.kernels": ["*.cpp"],  # built on first use (kernels/cpu_decode.py)
        "cotserve.steering_vectors": ["*.json", "*/*.json", "*/*.safetensors"],
    },
)
