"""A guard for refactors: the default run's outcomes, case by case, against a checked-in expectation.

The run is the default one (``conform`` with no option: PyTorch's built-in hooks, all
hook APIs, passes, known failures and skips). Its cases at world size 3 are held to the
expectation below: a restructuring of the suite must leave every outcome as it is; a
change of behaviour shows here as a diff, and an intended one is accepted with
``EXPECTTEST_ACCEPT=1 make test ARGS="-k outcomes_guard"`` (expecttest rewrites the
expectation below). The whole run's counts are held to README's "What the first summary
means", so that line, the first thing a newcomer compares, cannot drift (issue 31).

Outcomes depend on the torch build (README's compatibility table), so the
expectation applies to the torch CI runs: 2.13, CPU build.
"""

from __future__ import annotations

import os
import re
import unittest

from typing import Dict

import expecttest
import pytest
import torch

from conformance.reports.source_digest import source_digest
from tests.default_run_reuse import reused_default_run
from tests.meta_helpers import REPO, BackgroundJob, SuiteRun, pytest_counts, run_suite

RECORDED_WITH = "2.13"


def _default_run(runs: object, directory: str, env: Dict[str, str]) -> SuiteRun:
    """The default run: the one ``make conform`` just wrote to ``reports/`` where it was this suite's, on this
    torch (:func:`~tests.default_run_reuse.reused_default_run`: README's two commands in order, as CI runs them,
    run it once), else a run of its own."""
    reused, _ = reused_default_run(source_digest(), torch.__version__)
    if reused is not None:
        return reused
    return run_suite([], os.path.join(directory, "default.xml"), timeout=600, env=env)


#: The default run, in the zoo runs' background threads (``tests/conftest.py``).
DEFAULT_RUN = BackgroundJob("default_run", _default_run)
SAME_TORCH = torch.__version__.startswith(RECORDED_WITH + ".") and torch.version.cuda is None

#: The counts README's first summary gives, in pytest's words and order.
README_COUNTS = re.compile(r"`(\d+ passed, \d+ skipped, \d+ deselected, \d+ xfailed)`")


@unittest.skipUnless(SAME_TORCH, f"the expectation was recorded with torch {RECORDED_WITH} (CPU build); "
                                 f"this is torch {torch.__version__}, whose outcomes differ by design")
class TestOutcomesGuard(expecttest.TestCase):
    @pytest.fixture(autouse=True)
    def _zoo_runs(self, zoo_runs):
        self.zoo_runs = zoo_runs

    def test_readme_s_first_summary_gives_the_default_run_s_counts(self):
        run = self.zoo_runs(DEFAULT_RUN)
        self.assertEqual(run.returncode, 0, run.output[-3000:])
        got = run.closing_counts()
        closing = ", ".join(f"{n} {word}" for word, n in got.items())
        readme = open(os.path.join(REPO, "README.md")).read()
        summary = readme.split("\n## What the first summary means\n", 1)[1].split("\n## ", 1)[0]
        shown = README_COUNTS.search(summary).group(1)
        self.assertEqual({word: got.get(word, 0) for word in pytest_counts(shown)}, pytest_counts(shown),
                         f"README's 'What the first summary means' gives `{shown}`, but the default run ended "
                         f"`{closing}`: put the run's counts in README (and in docs/speed.md's default run)")

    def test_outcomes_of_every_world_size_3_case(self):
        run = self.zoo_runs(DEFAULT_RUN)
        self.assertEqual(run.returncode, 0, run.output[-3000:])
        text = "\n".join(f"{c.outcome:<8} {c.name}" for c in sorted(run.cases, key=lambda c: c.name)
                         if c.name.endswith("-ws3]"))
        self.assertExpectedInline(text, """\
passed   test_averaging[allreduce_hook-NO_SHARD-ws3]
xfailed  test_averaging[bf16_compress_hook-FULL_SHARD-ws3]
xfailed  test_averaging[bf16_compress_hook-NO_SHARD-ws3]
xfailed  test_averaging[bf16_compress_hook-SHARD_GRAD_OP-ws3]
xfailed  test_averaging[fp16_compress_hook-FULL_SHARD-ws3]
xfailed  test_averaging[fp16_compress_hook-NO_SHARD-ws3]
xfailed  test_averaging[fp16_compress_hook-SHARD_GRAD_OP-ws3]
passed   test_averaging[reduce_scatter_hook-FULL_SHARD-ws3]
passed   test_averaging[reduce_scatter_hook-SHARD_GRAD_OP-ws3]
passed   test_clip_grad_norm_low_precision[allreduce_hook-NO_SHARD-nested_wrapped-ws3]
skipped  test_clip_grad_norm_low_precision[bf16_compress_hook-FULL_SHARD-nested_wrapped-ws3]
skipped  test_clip_grad_norm_low_precision[bf16_compress_hook-NO_SHARD-nested_wrapped-ws3]
xfailed  test_clip_grad_norm_low_precision[fp16_compress_hook-FULL_SHARD-nested_wrapped-ws3]
xfailed  test_clip_grad_norm_low_precision[fp16_compress_hook-NO_SHARD-nested_wrapped-ws3]
passed   test_clip_grad_norm_low_precision[reduce_scatter_hook-FULL_SHARD-nested_wrapped-ws3]
passed   test_ddp_averaging[ddp_allreduce_hook-default-analytic_linear-ws3]
xfailed  test_ddp_averaging[ddp_bf16_compress_hook-default-analytic_linear-ws3]
xfailed  test_ddp_averaging[ddp_bf16_compress_wrapper_allreduce-default-analytic_linear-ws3]
passed   test_ddp_averaging[ddp_cpp_allreduce-default-analytic_linear-ws3]
passed   test_ddp_averaging[ddp_cpp_fp16_compress-default-analytic_linear-ws3]
passed   test_ddp_averaging[ddp_fp16_compress_hook-default-analytic_linear-ws3]
passed   test_ddp_averaging[ddp_fp16_compress_wrapper_allreduce-default-analytic_linear-ws3]
xfailed  test_ddp_averaging[ddp_noop_hook-default-analytic_linear-ws3]
passed   test_ddp_future_contract[ddp_allreduce_hook-bucket_per_param-gradient_probe-ws3]
passed   test_ddp_future_contract[ddp_allreduce_hook-bucket_view-gradient_probe-ws3]
passed   test_ddp_future_contract[ddp_allreduce_hook-default-net_flat-ws3]
passed   test_ddp_future_contract[ddp_allreduce_hook-find_unused-unused_param-ws3]
passed   test_ddp_future_contract[ddp_allreduce_hook-no_sync-gradient_probe-ws3]
passed   test_ddp_future_contract[ddp_allreduce_hook-skip_unused-unused_param-ws3]
passed   test_ddp_future_contract[ddp_allreduce_hook-small_buckets-nested_wrapped-ws3]
passed   test_ddp_future_contract[ddp_allreduce_hook-static_graph-net_flat-ws3]
xfailed  test_ddp_future_contract[ddp_batched_powerSGD_hook-bucket_per_param-gradient_probe-ws3]
xfailed  test_ddp_future_contract[ddp_batched_powerSGD_hook-bucket_view-gradient_probe-ws3]
xfailed  test_ddp_future_contract[ddp_batched_powerSGD_hook-default-net_flat-ws3]
xfailed  test_ddp_future_contract[ddp_batched_powerSGD_hook-find_unused-unused_param-ws3]
xfailed  test_ddp_future_contract[ddp_batched_powerSGD_hook-no_sync-gradient_probe-ws3]
xfailed  test_ddp_future_contract[ddp_batched_powerSGD_hook-skip_unused-unused_param-ws3]
xfailed  test_ddp_future_contract[ddp_batched_powerSGD_hook-small_buckets-nested_wrapped-ws3]
xfailed  test_ddp_future_contract[ddp_batched_powerSGD_hook-static_graph-net_flat-ws3]
xfailed  test_ddp_future_contract[ddp_bf16_compress_hook-bucket_per_param-gradient_probe-ws3]
xfailed  test_ddp_future_contract[ddp_bf16_compress_hook-bucket_view-gradient_probe-ws3]
xfailed  test_ddp_future_contract[ddp_bf16_compress_hook-default-net_flat-ws3]
xfailed  test_ddp_future_contract[ddp_bf16_compress_hook-find_unused-unused_param-ws3]
xfailed  test_ddp_future_contract[ddp_bf16_compress_hook-no_sync-gradient_probe-ws3]
xfailed  test_ddp_future_contract[ddp_bf16_compress_hook-skip_unused-unused_param-ws3]
xfailed  test_ddp_future_contract[ddp_bf16_compress_hook-small_buckets-nested_wrapped-ws3]
xfailed  test_ddp_future_contract[ddp_bf16_compress_hook-static_graph-net_flat-ws3]
xfailed  test_ddp_future_contract[ddp_bf16_compress_wrapper_allreduce-bucket_per_param-gradient_probe-ws3]
xfailed  test_ddp_future_contract[ddp_bf16_compress_wrapper_allreduce-bucket_view-gradient_probe-ws3]
xfailed  test_ddp_future_contract[ddp_bf16_compress_wrapper_allreduce-default-net_flat-ws3]
xfailed  test_ddp_future_contract[ddp_bf16_compress_wrapper_allreduce-find_unused-unused_param-ws3]
xfailed  test_ddp_future_contract[ddp_bf16_compress_wrapper_allreduce-no_sync-gradient_probe-ws3]
xfailed  test_ddp_future_contract[ddp_bf16_compress_wrapper_allreduce-skip_unused-unused_param-ws3]
xfailed  test_ddp_future_contract[ddp_bf16_compress_wrapper_allreduce-small_buckets-nested_wrapped-ws3]
xfailed  test_ddp_future_contract[ddp_bf16_compress_wrapper_allreduce-static_graph-net_flat-ws3]
skipped  test_ddp_future_contract[ddp_cpp_allreduce-bucket_per_param-gradient_probe-ws3]
skipped  test_ddp_future_contract[ddp_cpp_allreduce-bucket_view-gradient_probe-ws3]
skipped  test_ddp_future_contract[ddp_cpp_allreduce-default-net_flat-ws3]
skipped  test_ddp_future_contract[ddp_cpp_allreduce-find_unused-unused_param-ws3]
skipped  test_ddp_future_contract[ddp_cpp_allreduce-no_sync-gradient_probe-ws3]
skipped  test_ddp_future_contract[ddp_cpp_allreduce-skip_unused-unused_param-ws3]
skipped  test_ddp_future_contract[ddp_cpp_allreduce-small_buckets-nested_wrapped-ws3]
skipped  test_ddp_future_contract[ddp_cpp_allreduce-static_graph-net_flat-ws3]
skipped  test_ddp_future_contract[ddp_cpp_fp16_compress-bucket_per_param-gradient_probe-ws3]
skipped  test_ddp_future_contract[ddp_cpp_fp16_compress-bucket_view-gradient_probe-ws3]
skipped  test_ddp_future_contract[ddp_cpp_fp16_compress-default-net_flat-ws3]
skipped  test_ddp_future_contract[ddp_cpp_fp16_compress-find_unused-unused_param-ws3]
skipped  test_ddp_future_contract[ddp_cpp_fp16_compress-no_sync-gradient_probe-ws3]
skipped  test_ddp_future_contract[ddp_cpp_fp16_compress-skip_unused-unused_param-ws3]
skipped  test_ddp_future_contract[ddp_cpp_fp16_compress-small_buckets-nested_wrapped-ws3]
skipped  test_ddp_future_contract[ddp_cpp_fp16_compress-static_graph-net_flat-ws3]
passed   test_ddp_future_contract[ddp_fp16_compress_hook-bucket_per_param-gradient_probe-ws3]
passed   test_ddp_future_contract[ddp_fp16_compress_hook-bucket_view-gradient_probe-ws3]
passed   test_ddp_future_contract[ddp_fp16_compress_hook-default-net_flat-ws3]
passed   test_ddp_future_contract[ddp_fp16_compress_hook-find_unused-unused_param-ws3]
passed   test_ddp_future_contract[ddp_fp16_compress_hook-no_sync-gradient_probe-ws3]
passed   test_ddp_future_contract[ddp_fp16_compress_hook-skip_unused-unused_param-ws3]
passed   test_ddp_future_contract[ddp_fp16_compress_hook-small_buckets-nested_wrapped-ws3]
passed   test_ddp_future_contract[ddp_fp16_compress_hook-static_graph-net_flat-ws3]
xfailed  test_ddp_future_contract[ddp_fp16_compress_wrapper_allreduce-bucket_per_param-gradient_probe-ws3]
xfailed  test_ddp_future_contract[ddp_fp16_compress_wrapper_allreduce-bucket_view-gradient_probe-ws3]
xfailed  test_ddp_future_contract[ddp_fp16_compress_wrapper_allreduce-default-net_flat-ws3]
xfailed  test_ddp_future_contract[ddp_fp16_compress_wrapper_allreduce-find_unused-unused_param-ws3]
xfailed  test_ddp_future_contract[ddp_fp16_compress_wrapper_allreduce-no_sync-gradient_probe-ws3]
xfailed  test_ddp_future_contract[ddp_fp16_compress_wrapper_allreduce-skip_unused-unused_param-ws3]
xfailed  test_ddp_future_contract[ddp_fp16_compress_wrapper_allreduce-small_buckets-nested_wrapped-ws3]
xfailed  test_ddp_future_contract[ddp_fp16_compress_wrapper_allreduce-static_graph-net_flat-ws3]
passed   test_ddp_future_contract[ddp_noop_hook-bucket_per_param-gradient_probe-ws3]
passed   test_ddp_future_contract[ddp_noop_hook-bucket_view-gradient_probe-ws3]
passed   test_ddp_future_contract[ddp_noop_hook-default-net_flat-ws3]
passed   test_ddp_future_contract[ddp_noop_hook-find_unused-unused_param-ws3]
passed   test_ddp_future_contract[ddp_noop_hook-no_sync-gradient_probe-ws3]
passed   test_ddp_future_contract[ddp_noop_hook-skip_unused-unused_param-ws3]
passed   test_ddp_future_contract[ddp_noop_hook-small_buckets-nested_wrapped-ws3]
passed   test_ddp_future_contract[ddp_noop_hook-static_graph-net_flat-ws3]
xfailed  test_ddp_future_contract[ddp_powerSGD_hook-bucket_per_param-gradient_probe-ws3]
passed   test_ddp_future_contract[ddp_powerSGD_hook-bucket_view-gradient_probe-ws3]
passed   test_ddp_future_contract[ddp_powerSGD_hook-default-net_flat-ws3]
xfailed  test_ddp_future_contract[ddp_powerSGD_hook-find_unused-unused_param-ws3]
passed   test_ddp_future_contract[ddp_powerSGD_hook-no_sync-gradient_probe-ws3]
xfailed  test_ddp_future_contract[ddp_powerSGD_hook-skip_unused-unused_param-ws3]
xfailed  test_ddp_future_contract[ddp_powerSGD_hook-small_buckets-nested_wrapped-ws3]
passed   test_ddp_future_contract[ddp_powerSGD_hook-static_graph-net_flat-ws3]
xfailed  test_ddp_future_contract[ddp_quantization_perchannel_hook-bucket_per_param-gradient_probe-ws3]
xfailed  test_ddp_future_contract[ddp_quantization_perchannel_hook-bucket_view-gradient_probe-ws3]
xfailed  test_ddp_future_contract[ddp_quantization_perchannel_hook-default-net_flat-ws3]
xfailed  test_ddp_future_contract[ddp_quantization_perchannel_hook-find_unused-unused_param-ws3]
xfailed  test_ddp_future_contract[ddp_quantization_perchannel_hook-no_sync-gradient_probe-ws3]
xfailed  test_ddp_future_contract[ddp_quantization_perchannel_hook-skip_unused-unused_param-ws3]
xfailed  test_ddp_future_contract[ddp_quantization_perchannel_hook-small_buckets-nested_wrapped-ws3]
xfailed  test_ddp_future_contract[ddp_quantization_perchannel_hook-static_graph-net_flat-ws3]
xfailed  test_ddp_future_contract[ddp_quantization_pertensor_hook-bucket_per_param-gradient_probe-ws3]
xfailed  test_ddp_future_contract[ddp_quantization_pertensor_hook-bucket_view-gradient_probe-ws3]
xfailed  test_ddp_future_contract[ddp_quantization_pertensor_hook-default-net_flat-ws3]
xfailed  test_ddp_future_contract[ddp_quantization_pertensor_hook-find_unused-unused_param-ws3]
xfailed  test_ddp_future_contract[ddp_quantization_pertensor_hook-no_sync-gradient_probe-ws3]
xfailed  test_ddp_future_contract[ddp_quantization_pertensor_hook-skip_unused-unused_param-ws3]
xfailed  test_ddp_future_contract[ddp_quantization_pertensor_hook-small_buckets-nested_wrapped-ws3]
xfailed  test_ddp_future_contract[ddp_quantization_pertensor_hook-static_graph-net_flat-ws3]
xfailed  test_ddp_hard_inputs[ddp_allreduce_hook-bucket_per_param-gradient_probe-ws3]
xfailed  test_ddp_hard_inputs[ddp_allreduce_hook-default-gradient_probe-ws3]
xfailed  test_ddp_hard_inputs[ddp_allreduce_hook-default-large_probe-ws3]
xfailed  test_ddp_hard_inputs[ddp_bf16_compress_hook-bucket_per_param-gradient_probe-ws3]
xfailed  test_ddp_hard_inputs[ddp_bf16_compress_hook-default-gradient_probe-ws3]
xfailed  test_ddp_hard_inputs[ddp_bf16_compress_hook-default-large_probe-ws3]
xfailed  test_ddp_hard_inputs[ddp_bf16_compress_wrapper_allreduce-bucket_per_param-gradient_probe-ws3]
xfailed  test_ddp_hard_inputs[ddp_bf16_compress_wrapper_allreduce-default-gradient_probe-ws3]
xfailed  test_ddp_hard_inputs[ddp_bf16_compress_wrapper_allreduce-default-large_probe-ws3]
xfailed  test_ddp_hard_inputs[ddp_cpp_allreduce-bucket_per_param-gradient_probe-ws3]
xfailed  test_ddp_hard_inputs[ddp_cpp_allreduce-default-gradient_probe-ws3]
xfailed  test_ddp_hard_inputs[ddp_cpp_allreduce-default-large_probe-ws3]
passed   test_ddp_hard_inputs[ddp_cpp_fp16_compress-bucket_per_param-gradient_probe-ws3]
passed   test_ddp_hard_inputs[ddp_cpp_fp16_compress-default-gradient_probe-ws3]
passed   test_ddp_hard_inputs[ddp_cpp_fp16_compress-default-large_probe-ws3]
passed   test_ddp_hard_inputs[ddp_fp16_compress_hook-bucket_per_param-gradient_probe-ws3]
passed   test_ddp_hard_inputs[ddp_fp16_compress_hook-default-gradient_probe-ws3]
passed   test_ddp_hard_inputs[ddp_fp16_compress_hook-default-large_probe-ws3]
xfailed  test_ddp_hard_inputs[ddp_fp16_compress_wrapper_allreduce-bucket_per_param-gradient_probe-ws3]
xfailed  test_ddp_hard_inputs[ddp_fp16_compress_wrapper_allreduce-default-gradient_probe-ws3]
xfailed  test_ddp_hard_inputs[ddp_fp16_compress_wrapper_allreduce-default-large_probe-ws3]
xfailed  test_ddp_hard_inputs[ddp_noop_hook-bucket_per_param-gradient_probe-ws3]
xfailed  test_ddp_hard_inputs[ddp_noop_hook-default-gradient_probe-ws3]
xfailed  test_ddp_hard_inputs[ddp_noop_hook-default-large_probe-ws3]
xfailed  test_ddp_lossy_error[ddp_batched_powerSGD_hook-default-nested_wrapped-ws3]
passed   test_ddp_lossy_error[ddp_powerSGD_hook-default-nested_wrapped-ws3]
xfailed  test_ddp_lossy_error[ddp_quantization_perchannel_hook-default-nested_wrapped-ws3]
xfailed  test_ddp_lossy_error[ddp_quantization_pertensor_hook-default-nested_wrapped-ws3]
passed   test_ddp_parity[ddp_allreduce_hook-batched_grad_copy-nested_wrapped-ws3]
xfailed  test_ddp_parity[ddp_allreduce_hook-default-nested_wrapped-ws3]
skipped  test_ddp_parity[ddp_bf16_compress_hook-batched_grad_copy-nested_wrapped-ws3]
xfailed  test_ddp_parity[ddp_bf16_compress_hook-default-nested_wrapped-ws3]
skipped  test_ddp_parity[ddp_bf16_compress_wrapper_allreduce-batched_grad_copy-nested_wrapped-ws3]
xfailed  test_ddp_parity[ddp_bf16_compress_wrapper_allreduce-default-nested_wrapped-ws3]
passed   test_ddp_parity[ddp_cpp_allreduce-batched_grad_copy-nested_wrapped-ws3]
xfailed  test_ddp_parity[ddp_cpp_allreduce-default-nested_wrapped-ws3]
skipped  test_ddp_parity[ddp_cpp_fp16_compress-batched_grad_copy-nested_wrapped-ws3]
passed   test_ddp_parity[ddp_cpp_fp16_compress-default-nested_wrapped-ws3]
skipped  test_ddp_parity[ddp_fp16_compress_hook-batched_grad_copy-nested_wrapped-ws3]
passed   test_ddp_parity[ddp_fp16_compress_hook-default-nested_wrapped-ws3]
skipped  test_ddp_parity[ddp_fp16_compress_wrapper_allreduce-batched_grad_copy-nested_wrapped-ws3]
xfailed  test_ddp_parity[ddp_fp16_compress_wrapper_allreduce-default-nested_wrapped-ws3]
xfailed  test_ddp_parity[ddp_noop_hook-batched_grad_copy-nested_wrapped-ws3]
xfailed  test_ddp_parity[ddp_noop_hook-default-nested_wrapped-ws3]
passed   test_ddp_rank_consistency[ddp_allreduce_hook-default-net_flat-ws3]
xfailed  test_ddp_rank_consistency[ddp_batched_powerSGD_hook-default-net_flat-ws3]
xfailed  test_ddp_rank_consistency[ddp_bf16_compress_hook-default-net_flat-ws3]
xfailed  test_ddp_rank_consistency[ddp_bf16_compress_wrapper_allreduce-default-net_flat-ws3]
passed   test_ddp_rank_consistency[ddp_cpp_allreduce-default-net_flat-ws3]
passed   test_ddp_rank_consistency[ddp_cpp_fp16_compress-default-net_flat-ws3]
passed   test_ddp_rank_consistency[ddp_fp16_compress_hook-default-net_flat-ws3]
passed   test_ddp_rank_consistency[ddp_fp16_compress_wrapper_allreduce-default-net_flat-ws3]
xfailed  test_ddp_rank_consistency[ddp_noop_hook-default-net_flat-ws3]
passed   test_ddp_rank_consistency[ddp_powerSGD_hook-default-net_flat-ws3]
xfailed  test_ddp_rank_consistency[ddp_quantization_perchannel_hook-default-net_flat-ws3]
xfailed  test_ddp_rank_consistency[ddp_quantization_pertensor_hook-default-net_flat-ws3]
passed   test_fsdp2_all_gather_hard_params[plain_all_gather-default-large_probe-ws3]
passed   test_fsdp2_all_gather_parity[plain_all_gather-default-always_wrap_nested-ws3]
passed   test_fsdp2_hard_inputs[plain_reduce_scatter-default-gradient_probe-ws3]
passed   test_fsdp2_hard_inputs[plain_reduce_scatter-default-large_probe-ws3]
passed   test_fsdp2_hard_inputs[plain_reduce_scatter_bf16-default-gradient_probe-ws3]
passed   test_fsdp2_hard_inputs[plain_reduce_scatter_bf16-default-large_probe-ws3]
passed   test_fsdp2_hard_inputs[plain_reduce_scatter_fp16-default-gradient_probe-ws3]
passed   test_fsdp2_hard_inputs[plain_reduce_scatter_fp16-default-large_probe-ws3]
passed   test_fsdp2_parity[plain_reduce_scatter-default-gradient_probe-ws3]
passed   test_fsdp2_parity[plain_reduce_scatter-default-nested_wrapped-ws3]
skipped  test_fsdp2_parity[plain_reduce_scatter-divide_factor-nested_wrapped-ws3]
passed   test_fsdp2_parity[plain_reduce_scatter-divide_factor_force_sum-nested_wrapped-ws3]
passed   test_fsdp2_parity[plain_reduce_scatter-force_sum-gradient_probe-ws3]
passed   test_fsdp2_parity[plain_reduce_scatter-sum_no_divide-gradient_probe-ws3]
passed   test_fsdp2_parity[plain_reduce_scatter_bf16-default-gradient_probe-ws3]
passed   test_fsdp2_parity[plain_reduce_scatter_bf16-default-nested_wrapped-ws3]
skipped  test_fsdp2_parity[plain_reduce_scatter_bf16-divide_factor-nested_wrapped-ws3]
passed   test_fsdp2_parity[plain_reduce_scatter_bf16-divide_factor_force_sum-nested_wrapped-ws3]
passed   test_fsdp2_parity[plain_reduce_scatter_bf16-force_sum-gradient_probe-ws3]
passed   test_fsdp2_parity[plain_reduce_scatter_bf16-sum_no_divide-gradient_probe-ws3]
passed   test_fsdp2_parity[plain_reduce_scatter_fp16-default-gradient_probe-ws3]
passed   test_fsdp2_parity[plain_reduce_scatter_fp16-default-nested_wrapped-ws3]
passed   test_fsdp2_parity[plain_reduce_scatter_fp16-divide_factor-nested_wrapped-ws3]
passed   test_fsdp2_parity[plain_reduce_scatter_fp16-divide_factor_force_sum-nested_wrapped-ws3]
passed   test_fsdp2_parity[plain_reduce_scatter_fp16-force_sum-gradient_probe-ws3]
passed   test_fsdp2_parity[plain_reduce_scatter_fp16-sum_no_divide-gradient_probe-ws3]
passed   test_hard_inputs[allreduce_hook-NO_SHARD-large_probe-ws3]
passed   test_hard_inputs[allreduce_hook-NO_SHARD-ws3]
xfailed  test_hard_inputs[bf16_compress_hook-FULL_SHARD-large_probe-ws3]
xfailed  test_hard_inputs[bf16_compress_hook-FULL_SHARD-ws3]
xfailed  test_hard_inputs[bf16_compress_hook-NO_SHARD-large_probe-ws3]
xfailed  test_hard_inputs[bf16_compress_hook-NO_SHARD-ws3]
xfailed  test_hard_inputs[bf16_compress_hook-SHARD_GRAD_OP-ws3]
xfailed  test_hard_inputs[fp16_compress_hook-FULL_SHARD-large_probe-ws3]
xfailed  test_hard_inputs[fp16_compress_hook-FULL_SHARD-ws3]
xfailed  test_hard_inputs[fp16_compress_hook-NO_SHARD-large_probe-ws3]
xfailed  test_hard_inputs[fp16_compress_hook-NO_SHARD-ws3]
xfailed  test_hard_inputs[fp16_compress_hook-SHARD_GRAD_OP-ws3]
passed   test_hard_inputs[reduce_scatter_hook-FULL_SHARD-large_probe-ws3]
passed   test_hard_inputs[reduce_scatter_hook-FULL_SHARD-ws3]
passed   test_hard_inputs[reduce_scatter_hook-SHARD_GRAD_OP-ws3]
passed   test_parity[allreduce_hook-NO_SHARD-nested_wrapped-ws3]
passed   test_parity[allreduce_hook-NO_SHARD-net_wrapped-ws3]
xfailed  test_parity[bf16_compress_hook-FULL_SHARD-nested_wrapped-ws3]
xfailed  test_parity[bf16_compress_hook-FULL_SHARD-net_wrapped-ws3]
xfailed  test_parity[bf16_compress_hook-NO_SHARD-nested_wrapped-ws3]
xfailed  test_parity[bf16_compress_hook-NO_SHARD-net_wrapped-ws3]
xfailed  test_parity[bf16_compress_hook-SHARD_GRAD_OP-nested_wrapped-ws3]
xfailed  test_parity[bf16_compress_hook-SHARD_GRAD_OP-net_wrapped-ws3]
xfailed  test_parity[fp16_compress_hook-FULL_SHARD-nested_wrapped-ws3]
xfailed  test_parity[fp16_compress_hook-FULL_SHARD-net_wrapped-ws3]
xfailed  test_parity[fp16_compress_hook-NO_SHARD-nested_wrapped-ws3]
xfailed  test_parity[fp16_compress_hook-NO_SHARD-net_wrapped-ws3]
xfailed  test_parity[fp16_compress_hook-SHARD_GRAD_OP-nested_wrapped-ws3]
xfailed  test_parity[fp16_compress_hook-SHARD_GRAD_OP-net_wrapped-ws3]
passed   test_parity[reduce_scatter_hook-FULL_SHARD-nested_wrapped-ws3]
passed   test_parity[reduce_scatter_hook-FULL_SHARD-net_wrapped-ws3]
passed   test_parity[reduce_scatter_hook-SHARD_GRAD_OP-nested_wrapped-ws3]
passed   test_parity[reduce_scatter_hook-SHARD_GRAD_OP-net_wrapped-ws3]
passed   test_rank_consistency[allreduce_hook-NO_SHARD-net_wrapped-ws3]
xfailed  test_rank_consistency[bf16_compress_hook-NO_SHARD-net_wrapped-ws3]
xfailed  test_rank_consistency[fp16_compress_hook-NO_SHARD-net_wrapped-ws3]""")
