"""The FSDP2 family's setup object: one folder per API, each one ``SETUP`` that both builds read, no API names.

``conformance/apis/fsdp2``, ``fsdp2_all_reduce``, ``fsdp2_replica`` and ``fsdp2_all_gather`` each hold their
:class:`~conformance.apis.fsdp2_common.setup.Fsdp2Setup` (``standalone.py``: ``SETUP``); the suite's models
(``fsdp2_common/models.py``) and a reproducer's build (``fsdp2_common/standalone.py``) read it. These tests hold
that shape: what each config asks of FSDP2, the references, the reproducer's torch-only modules, and no code of
the family that branches on an API's name.
"""

from __future__ import annotations

import ast
import importlib
import os

import pytest
import torch

from conformance.apis.controller_side import controller_side
from conformance.apis.fsdp2_common.setup import Fsdp2Config, Fsdp2Setup, bind_comm, hsdp_shape, replica_shape
from conformance.apis.registry import HOOK_APIS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILY = ("fsdp2", "fsdp2_all_reduce", "fsdp2_replica", "fsdp2_all_gather")
FOLDERS = FAMILY + ("fsdp2_common",)


def _setup(api: str) -> Fsdp2Setup:
    return controller_side(api).standalone[-1].SETUP


def test_each_api_of_the_family_is_its_own_folder_with_its_setup():
    for api in FAMILY:
        modules = controller_side(api).standalone_modules
        assert modules == ("conformance.apis.fsdp2_common.setup", "conformance.apis.fsdp2_common.standalone",
                           f"conformance.apis.{api}.standalone"), modules
        assert HOOK_APIS[api].models.startswith(f"conformance.apis.{api}.models:")
        assert HOOK_APIS[api].checks["registration"] == f"conformance.apis.{api}.models:registration"
        assert isinstance(_setup(api), Fsdp2Setup)
    assert [_setup(api).setter for api in FAMILY] == ["set_custom_reduce_scatter", "set_all_reduce_hook",
                                                      "set_all_reduce_hook", "set_custom_all_gather"]


def test_every_planned_config_is_one_of_the_setup_s():
    """A case's config is looked up in its API's setup, by the models and the reproducer alike."""
    from tests.meta_helpers import plan_settings
    from tests.zoo import fsdp2_all_gathers, fsdp2_comms

    for api in FAMILY:
        for test in HOOK_APIS[api].plans:
            from conformance.apis.registry import planned_cases
            for settings in (plan_settings(2, 3), plan_settings(4, 6, depth="nightly")):
                for case in planned_cases(test, fsdp2_comms.ALL + fsdp2_all_gathers.ALL, settings):
                    assert case.variant in _setup(api).configs, (api, test, case.id)


def test_what_each_comm_config_asks_of_fsdp2():
    """The FSDPModule methods, the accumulation setter and PREMUL_SUM, as FSDP2's _get_gradient_divide_factors
    decides them (the table the plan skips by)."""
    configs = _setup("fsdp2").configs
    assert {name: c.methods for name, c in configs.items() if c.methods} == {
        "divide_factor": ("set_gradient_divide_factor",), "force_sum": ("set_force_sum_reduction_for_comms",),
        "divide_factor_force_sum": ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms"),
        "divide_factor_some": ("set_gradient_divide_factor",), "hsdp_divide_factor": ("set_gradient_divide_factor",),
        "unused_params": ("set_reduce_scatter_unused_params",),
        "sum_no_divide": ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms")}
    # sum_no_divide: factor 1.0 with the forced SUM, so no PREMUL_SUM (FSDP2 hands SUM and divides nothing)
    assert configs["sum_no_divide"].divide_factor(3) == 1.0 and configs["sum_no_divide"].force_sum
    # a torch without a config's setter skips its cases, saying so
    assert _setup("fsdp2_all_gather").configs["reshard_root"].methods == ("set_reshard_after_forward",)
    assert [n for n, c in configs.items() if c.premul_sum(None)] == ["divide_factor", "divide_factor_some",
                                                                    "hsdp_divide_factor"]
    assert not configs["divide_factor"].premul_sum(torch.float16)
    assert [n for n, c in configs.items() if c.sync_setter == "set_requires_all_reduce"] == ["hsdp",
                                                                                            "hsdp_divide_factor"]
    replicate_sum = _setup("fsdp2_all_reduce").configs["replicate_sum"]
    assert replicate_sum.divide_factor(4) == 1.0 and not replicate_sum.premul_sum(None)  # no reduce-scatter there


def test_meshes_and_the_dimension_that_shards():
    assert _setup("fsdp2").configs["hsdp"].shape(6) == hsdp_shape(6) == (2, 3)
    assert _setup("fsdp2").configs["subgroup"].shape(2) == (2,)
    assert _setup("fsdp2").configs["replicate"].shape(4) is None
    replica = _setup("fsdp2_replica").configs["replica"]
    assert (replica.shape(6), replica.shape(2), replica.hooked_dim) == ((3, 2), (2, 1), "shard")
    assert replica_shape(4) == (2, 2)
    with pytest.raises(ValueError, match="got 5"):
        replica.shape(5)
    assert all(c.hooked_dim is None for api in ("fsdp2", "fsdp2_all_reduce") for c in _setup(api).configs.values())


def test_the_reference_is_one_text_for_the_models_and_the_reproducer():
    assert _setup("fsdp2").reference("hsdp", 4, "bfloat16") == "native fully_shard with reduce_dtype=bfloat16"
    assert _setup("fsdp2").reference("replicate", 2, None) == "replicate (on FSDP2) without the comm"
    assert _setup("fsdp2_all_reduce").reference("replicate_sum", 2, None) == \
        "replicate (on FSDP2) without the hook, set_gradient_divide_factor(1.0)"
    assert _setup("fsdp2_replica").reference("replica", 6, None) == "native HSDP on the 3x2 mesh"


def test_how_each_hook_is_bound():
    class Comm:
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, *args, **kwargs):
            return None

    comm = Comm()
    assert bind_comm(comm, None, "c", None) is comm and isinstance(bind_comm(Comm, None, "c", None), Comm)
    with pytest.raises(TypeError, match="the factory of hook 'f' returned 1"):
        _setup("fsdp2").bound(lambda: 1, None, "f", None)
    hook = _setup("fsdp2_all_reduce").bind(len, None, "h", None)
    assert hook is len

    class Mesh:
        def get_group(self, name):
            return f"the {name} group"

    seen = []
    bound = _setup("fsdp2_replica").bind(lambda state, tensor: seen.append((state, tensor)),
                                         lambda group: f"state of {group}", "r", Mesh())
    bound("t")
    assert seen == [("state of the replicate group", "t")]


def test_a_config_is_a_frozen_value():
    config = Fsdp2Config("x")
    with pytest.raises(AttributeError):
        config.mesh = "hsdp"  # type: ignore[misc]


def _modules():
    for folder in FOLDERS:
        root = os.path.join(REPO, "conformance", "apis", folder)
        for name in sorted(os.listdir(root)):
            if name.endswith(".py"):
                yield os.path.join("conformance", "apis", folder, name)


@pytest.mark.parametrize("path", list(_modules()))
def test_no_code_of_the_family_branches_on_an_api_name(path):
    """No comparison with an API's name and no read of the case's ``api`` (``CASE["api"]``, ``case.api``): what
    differs between the APIs is in their setup objects and their folders."""
    tree = ast.parse(open(os.path.join(REPO, path)).read())
    names = set(HOOK_APIS)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for operand in operands:
                values = [e for e in getattr(operand, "elts", [operand]) if isinstance(e, ast.Constant)]
                found += [f"line {node.lineno}: compares with {v.value!r}" for v in values if v.value in names]
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "api":
            found.append(f"line {node.lineno}: reads ['api']")
        elif isinstance(node, ast.Attribute) and node.attr == "api" and getattr(node.value, "id", "") == "case":
            found.append(f"line {node.lineno}: reads case.api")
    assert not found, found


@pytest.mark.parametrize("module", ["conformance.apis.fsdp2_common.setup", "conformance.apis.fsdp2_common.standalone",
                                    *(f"conformance.apis.{api}.standalone" for api in FAMILY)])
def test_what_a_reproducer_holds_imports_only_torch_and_the_standard_library(module):
    """The modules written into an FSDP2 reproducer: their imports of the suite are each other (written in the
    file before them), the rest torch and the standard library; an ``if TYPE_CHECKING:`` block's imports never run,
    and the writer leaves the block out."""
    tree = ast.parse(open(importlib.import_module(module).__file__).read())
    written = set(controller_side("fsdp2").standalone_modules[:2])
    typing_only = {id(n) for stmt in tree.body if isinstance(stmt, ast.If) and getattr(stmt.test, "id", "") ==
                   "TYPE_CHECKING" for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            name = node.module or ""
        elif isinstance(node, ast.Import):
            name = node.names[0].name
        else:
            continue
        top = name.split(".")[0]
        assert name in written or top in {"torch", "__future__", "contextlib", "dataclasses", "functools",
                                          "typing"}, (module, name)


def test_a_configs_setters_are_called_on_the_root_once_built():
    from torch import nn

    from conformance.apis.fsdp2_common.standalone import apply_config

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = []

        def set_reshard_after_forward(self, value):
            self.calls.append(("set_reshard_after_forward", value))

    root = Root()
    apply_config(root, _setup("fsdp2_all_gather").configs["reshard_root"], 2)
    assert root.calls == [("set_reshard_after_forward", True)]
    apply_config(root, _setup("fsdp2_all_gather").configs["default"], 2)
    assert len(root.calls) == 1  # a config without setters calls none
