"""Installs the repository's top-level folders under one `deepinfer` namespace.

The folders stay where they are (the tree is the process diagram, DESIGN.md §2); setuptools maps each
to `deepinfer.<folder>` (`engine/` -> `deepinfer.engine`), and `deepinfer/` holds the namespace's own
`__init__.py` (the public API: `from deepinfer import LLM, SamplingParams`). Everything else is in
pyproject.toml.
"""

from setuptools import find_packages, setup

SUBPACKAGES = ["engine", "serving", "entrypoint", "vision_worker", "prefill_worker", "decode_worker", "kv_transfer",
               "loadbalancer", "kernels", "csrc", "protos", "deploy", "benchmarks", "tools", "evals", "kvstore"]
"""Top-level folders installed as `deepinfer.<name>` (with their subpackages)."""

package_dir = {"deepinfer": "deepinfer"}
packages = ["deepinfer"]
for name in SUBPACKAGES:
    package_dir[f"deepinfer.{name}"] = name
    packages += [f"deepinfer.{p}" for p in find_packages(include=[name, f"{name}.*"])]

setup(packages=packages, package_dir=package_dir)
