"""The run environments the tests of ``conformance.controller.known_failures`` judge entries against
(``tests/test_known_failures*.py``)."""

from __future__ import annotations

from conformance.controller.known_failures import RunEnvironment

CPU = RunEnvironment(backend="gloo", device="cpu", torch_version="2.13.0+cpu")
CUDA = RunEnvironment(backend="nccl", device="cuda", torch_version="2.13.0+cu126")
CUDA_BUILD_ON_CPU = RunEnvironment(backend="gloo", device="cpu", torch_version="2.11.0+cu128", cuda_build=True)
