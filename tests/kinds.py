"""Which kind of test each module of ``tests/`` holds, so a contributor can run the project's tests in parts.

Every ``tests/test_*.py`` module is named here (``tests/conftest.py`` refuses to collect one that is not, and
``tests/test_kinds.py`` checks this table against the files), with its kind: one of :data:`KINDS`, and
``torchrun`` besides where it launches torchrun. ``tests/conftest.py`` marks every test of the module with
them, so ``pytest -m unit`` (``make test-fast``), ``-m meta``, ``-m "not meta"`` or ``-m torchrun`` select a
part. A test that carries a kind of its own (``@pytest.mark.cli`` on the one test of a unit module that starts a
child interpreter) keeps it instead of its module's.

The kinds, cheapest first (``pyproject.toml`` registers each, with ``--strict-markers``):

* ``unit``: in this process, or small child interpreters that import neither torch nor the suite: no rank,
  no process group across processes, no run of the suite. Seconds for the lot of a module.
* ``cli``: ``python -m conformance`` in a child interpreter that stops before any rank starts (a usage error,
  ``--help``, ``--co``): seconds each, for importing torch and pytest's plugins.
* ``ranks``: starts ranks: a rank pool (``RankPool``, the zygote), or ``torch.multiprocessing`` ranks in a
  gloo process group.
* ``suite``: runs the suite end to end (``python -m conformance`` over cases that start ranks, or ``conform()``
  in this process), over PyTorch's hooks, the examples or a zoo module of ``tests/zoo/``.
* ``meta``: the meta-tests: they read a zoo's meta-run (``tests/meta_zoos/``, one run per zoo per session
  through the ``zoo_runs`` fixture), the suite judged by its JUnit XML over hooks whose bugs are known.
"""

from __future__ import annotations

from typing import Dict, Tuple

#: The kinds a test module can be, cheapest first, with the line ``pyproject.toml`` registers for each.
KINDS = {
    "unit": "in this process or small child interpreters without torch: no rank, no run of the suite",
    "cli": "python -m conformance in a child interpreter that stops before any rank starts",
    "ranks": "starts ranks: a rank pool, the zygote, or torch.multiprocessing ranks in a gloo group",
    "suite": "runs the suite end to end over cases that start ranks",
    "meta": "reads a zoo's meta-run (tests/meta_zoos/ through zoo_runs): the suite judged over known bugs",
}
#: Marks a module may carry besides its kind.
EXTRAS = {
    "torchrun": "launches torchrun",
}

#: ``tests/test_<name>.py`` -> its kind, then any of :data:`EXTRAS`.
MODULES: Dict[str, Tuple[str, ...]] = {
    "test_analytic_check": ("ranks",),
    "test_api_names": ("unit",),
    "test_attribution": ("unit",),
    "test_catalogue": ("unit",),
    "test_default_run_reuse": ("unit",),
    "test_docs": ("cli",),
    "test_fsdp2_setup": ("unit",),
    "test_gather_outcomes": ("unit",),
    "test_layers": ("unit",),
    "test_typed_parameters": ("unit",),
    "test_module_sizes": ("unit",),
    "test_bench_sample": ("unit",),
    "test_bookkeeper": ("unit",),
    "test_case_path": ("ranks",),
    "test_cases": ("unit",),
    "test_cases_plans": ("unit",),
    "test_claim_plans": ("unit",),
    "test_native_modes": ("unit",),
    "test_nccl_env": ("unit",),
    "test_cost_meter": ("unit",),
    "test_spec_fit": ("unit",),
    "test_cause_identity": ("unit",),
    "test_cause_summary": ("unit",),
    "test_ci_failures": ("unit",),
    "test_cli_help": ("cli",),
    "test_collector": ("cli",),
    "test_compare": ("unit",),
    "test_compare_ulps": ("unit",),
    "test_compiled_ddp": ("suite",),
    "test_containment": ("suite",),
    "test_cost": ("suite",),
    "test_cpp_hooks": ("unit",),
    "test_ddp_recorder": ("unit",),
    "test_default_replay": ("suite",),
    "test_diagnosis": ("ranks",),
    "test_two_level_diagnosis": ("ranks",),
    "test_failure_output": ("suite",),
    "test_fixed_twins": ("meta",),
    "test_fsdp2_registration": ("suite",),
    "test_fsdp2_replica": ("unit",),
    "test_fsdp2_setters": ("ranks",),
    "test_hook_call": ("ranks",),
    "test_hook_code": ("unit",),
    "test_hook_code_bits": ("suite",),
    "test_hard_inputs": ("unit",),
    "test_interrupt": ("suite",),
    "test_isolation": ("suite",),
    "test_kinds": ("unit",),
    "test_known_failures": ("unit",),
    "test_known_failures_book": ("unit",),
    "test_known_failures_repo": ("unit",),
    "test_known_failures_draft": ("unit",),
    "test_known_failures_report": ("suite",),
    "test_lifeline": ("unit",),
    "test_listener": ("unit",),
    "test_long_run": ("unit",),
    "test_markdown_reasons": ("unit",),
    "test_matrix_not_run": ("unit",),
    "test_meta": ("meta",),
    "test_meta_ddp": ("meta",),
    "test_meta_fsdp": ("meta",),
    "test_meta_fsdp2": ("meta",),
    "test_meta_fsdp2_all_gather": ("meta",),
    "test_meta_lossy": ("meta",),
    "test_meta_reach": ("meta", "torchrun"),
    "test_meta_switches": ("meta",),
    "test_models": ("unit",),
    "test_models_fsdp": ("unit",),
    "test_models_extra": ("unit",),
    "test_newcomer": ("suite",),
    "test_not_the_hooks_fault": ("suite",),
    "test_outcomes_guard": ("suite",),
    "test_packaging": ("unit",),
    "test_param_dtype": ("unit",),
    "test_phase_board": ("unit",),
    "test_process_state": ("unit",),
    "test_protocol_kinds": ("unit",),
    "test_rank_limits": ("suite",),
    "test_rank_log": ("unit",),
    "test_reach": ("unit",),
    "test_readme_example": ("suite",),
    "test_redundancy": ("suite",),
    "test_reference_replay": ("ranks",),
    "test_remote_link": ("unit",),
    "test_report": ("unit",),
    "test_report_files": ("suite",),
    "test_reproducer_content": ("unit",),
    "test_reproducer_memo": ("unit",),
    "test_reproducers": ("meta", "torchrun"),
    "test_rerun_command": ("unit",),
    "test_results": ("unit",),
    "test_results_run": ("suite",),
    "test_rounded_input": ("unit",),
    "test_runner": ("unit",),
    "test_session_report": ("suite",),
    "test_settings": ("unit",),
    "test_settings_nightly": ("unit",),
    "test_settings_world_sizes": ("unit",),
    "test_setup_env": ("unit",),
    "test_spec": ("unit",),
    "test_spec_loading": ("unit",),
    "test_strict_known_failures": ("cli",),
    "test_switch_plans": ("unit",),
    "test_suite_checkout": ("unit",),
    "test_topology": ("unit",),
    "test_torchrun": ("suite", "torchrun"),
    "test_user_repo": ("suite",),
    "test_verdict": ("unit",),
    "test_zygote": ("ranks",),
}
