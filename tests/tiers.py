"""The quick tier: what ``./dev.sh test`` (and CI) leaves to ``--full``.

The whole suite takes about 15 minutes on two CPU cores, most of it XLA
compiling small programs (every kernel runs in Pallas interpret mode); the
quick tier about 9 (four in five of the tests). It keeps every kernel
against its reference, every family's rule against optax and torch, and at
least one training-parity case of every feature, and leaves to ``./dev.sh
test --full`` (``pytest --full``) the cases below: each group says what
stays and why the rest can wait. pytest reports the cases left
out as "deselected" (under pytest-xdist, in the closing "quick tier" line),
never as passed.

An entry names a test file, a test (all its cases) or one case, as pytest
prints node ids; ``keep`` takes cases of a listed test back into the quick
tier. GPU-marked tests are never left out (on the H200 ``-m gpu`` runs them
all), and naming tests on the command line (``file::test``) runs them
whatever their tier. ``tests/conftest.py`` applies this and refuses an entry
that names nothing.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Group:
  why: str
  full: tuple[str, ...]
  keep: tuple[str, ...] = ()


def _cases(test: str, *ids: str) -> tuple[str, ...]:
  return tuple(f"{test}[{i}]" for i in ids)


T = "tests/"
GROUPS = (
    Group("The benchmark scripts run end to end on the CPU (their drivers, "
          "CSV rows and plots). The quick tier keeps a check of each "
          "script's model and the CLI errors; the figures themselves come "
          "from the H200.",
          full=(T + "test_llama8b_bench.py", T + "test_e2e_bench.py",
                T + "test_e2e_paired.py", T + "test_torch_e2e_bench.py",
                T + "test_kernel_bench_torch.py", T + "test_hlo_schedule.py",
                T + "test_memory_bench.py::test_weight_gradient_gemms_found"
                "_for_optax_and_absent_for_forge",
                T + "test_bench_clis.py::test_plot_help_is_not_a_traceback",
                T + "test_bench_clis.py::test_plan_checks_times_both_arms"
                "_taking_every_plan",
                T + "test_bench_clis.py::test_plot_missing_args_is_usage_error",
                T + "test_bench_clis.py::test_help_states_each_default_once",
                T + "test_bench_clis.py::test_replot_of_a_missing_csv_is_a"
                "_usage_error",
                T + "test_bench_clis.py::test_low_precision_error_rejects"
                "_nonpositive_shapes",
                T + "test_bench_clis.py::test_hlo_schedule_missing_or_truncated"
                "_file_is_a_clean_error",
                T + "test_cli_errors.py::test_plot_into_missing_directory",
                T + "test_cli_errors.py::test_plot_non_kernel_csv_is_clean_error",
                T + "test_bench_clis.py::test_torch_overhead_writes_rows_and"
                "_restores_the_bridge[direct]"),
          keep=(T + "test_e2e_bench.py::test_forge_arm_runs_fused_kernels",
                T + "test_e2e_bench.py::test_replot_draws_each_bts_bars_from_one"
                "_run",
                T + "test_e2e_paired.py::test_scanned_stack_model",
                T + "test_e2e_paired.py::test_every_model_flag_reaches_the"
                "_processes",
                T + "test_torch_e2e_bench.py::test_the_torch_decoder_is_the_jax"
                "_benchmarks_model",
                T + "test_kernel_bench_torch.py::test_torch_and_forge_torch"
                "_arms_compute_the_same_step",
                T + "test_memory_bench.py::test_weight_gradient_gemms_found"
                "_for_optax_and_absent_for_forge[adamw]")),
    Group("forge_torch's native host path against its Python path: each "
          "case builds the C++ extension first (20-30 s on two cores), as "
          "does torch_overhead's direct-launch stand-in. The quick tier "
          "keeps a failed build's fallback, which builds nothing; on the "
          "GPU the plans' bit-for-bit test runs both paths.",
          full=(T + "test_torch_native.py",),
          keep=(T + "test_torch_native.py::test_a_failed_build_keeps_the"
                "_python_path_and_says_why",)),
    Group("The multi-device checks: one process on eight simulated CPU "
          "devices training every layout (about a minute). The quick tier "
          "keeps the layout planning, argument checks and the lowering for "
          "eight H200s.",
          full=(T + "test_distributed.py::test_layouts_train_as_optax_in_place"
                "_keeping_shardings",
                T + "test_distributed.py::test_decoder_and_mlp_layouts_match"
                "_one_device",
                T + "test_distributed.py::test_no_weight_sized_copy_per_device",
                T + "test_distributed.py::test_tied_kernel_under_fsdp",
                T + "test_distributed.py::test_each_reduction_holds_one_layers"
                "_gradient",
                T + "test_distributed.py::test_unsupported_layouts_are_refused",
                T + "test_distributed.py::test_check_vma_catches_a_missing"
                "_reduction",
                T + "test_distributed.py::test_convert_on_a_mesh_skips_kernels"
                "_of_more_than_two_axes",
                T + "test_distributed.py::test_a_rematerialised_layer_trains"
                "_on_a_data_parallel_mesh",
                T + "test_torch_distributed.py::test_four_ranks_match_single"
                "_process_adamw",
                T + "test_torch_distributed.py::test_ddp_matches_single_process"
                "_adamw[accumulated]")),
    Group("Training parity of every family through a layer. Every family's "
          "rule is checked against optax and torch at one step in the quick "
          "tier (test_rule_matches_optax_one_step, the kernel and lowering "
          "tests); training through the layers keeps one case per regime "
          "and per kind of state.",
          full=(T + "test_families.py::test_mlp_training_matches_optax",
                T + "test_regimes23.py::test_mlp_training_matches_optax",
                T + "test_regimes23.py::test_untouched_layer_gets_the_zero"
                "_gradient_update",
                T + "test_regimes23.py::test_deferred_path_keeps_wide_gradients",
                T + "test_more_families.py::test_mlp_training_matches_the"
                "_transform_and_the_paper",
                T + "test_torch_families.py::test_fp32_parity_with_torch",
                T + "test_torch_low_precision.py::test_quantized_steps_match"
                "_the_reference_rule",
                T + "test_accumulate.py::test_k_micro_steps_equal_one_step_on"
                "_the_concatenated_batch",
                T + "test_accumulate.py::test_k_schedule",
                T + "test_blocks.py::test_other_regime_1_families_match",
                T + "test_real_models.py::test_injected_hyperparameters_drive"
                "_the_kernels",
                T + "test_shared_weights.py::test_multisteps_with_standard"
                "_fallback",
                T + "test_shared_weights.py::test_standard_fallback_in_other"
                "_regimes",
                T + "test_nnx.py::test_mlp_trains_like_nnx_and_optax",
                T + "test_clipping.py::test_jax_clipped_regime_2_families"
                "_match_the_optax_chain",
                T + "test_make_step_inputs.py::test_a_bf16_models_state"
                "_keeps_optaxs_promoted_dtypes"),
          keep=(_cases(T + "test_make_step_inputs.py::test_a_bf16_models"
                       "_state_keeps_optaxs_promoted_dtypes", "adamw",
                       "lars_injected")
                + _cases(T + "test_nnx.py::test_mlp_trains_like_nnx_and"
                         "_optax", "adamw-path-mask")
                + _cases(T + "test_clipping.py::test_jax_clipped_regime_2"
                         "_families_match_the_optax_chain", "muon")
                + _cases(T + "test_families.py::test_mlp_training_matches"
                         "_optax", "adamw-fused", "adamw-xla", "lion-fused",
                         "sgd_nesterov-fused",
                         "rmsprop_centered_momentum_bias_correction-fused")
                + _cases(T + "test_regimes23.py::test_mlp_training_matches"
                         "_optax", "muon", "adafactor_default", "sm3")
                + _cases(T + "test_regimes23.py::test_untouched_layer_gets"
                         "_the_zero_gradient_update", "muon", "adafactor"
                         "_factored_momentum_wd")
                + _cases(T + "test_regimes23.py::test_deferred_path_keeps"
                         "_wide_gradients", "adafactor-f64")
                + _cases(T + "test_more_families.py::test_mlp_training"
                         "_matches_the_transform_and_the_paper", "adam_mini",
                         "lars_nesterov_masks", "scion_unconstrained")
                + _cases(T + "test_torch_families.py::test_fp32_parity_with"
                         "_torch", "sgd-momentum-dampening-wd", "adagrad",
                         "rmsprop-centered-momentum-maximize", "adam-wd",
                         "adam-amsgrad-maximize", "adamw-fused-amsgrad-"
                         "maximize", "adamw-group-coupled", "adam-tensor-betas",
                         "nadam-decoupled", "nadam-tensor-betas",
                         "radam-tensor-betas", "radam-decoupled")
                + _cases(T + "test_torch_low_precision.py::test_quantized"
                         "_steps_match_the_reference_rule", "adamw-int8-fp32")
                + _cases(T + "test_accumulate.py::test_k_micro_steps_equal"
                         "_one_step_on_the_concatenated_batch", "adamw_exact",
                         "sgd_momentum_momentum")
                + _cases(T + "test_accumulate.py::test_k_schedule",
                         "adamw_exact")
                + _cases(T + "test_blocks.py::test_other_regime_1_families"
                         "_match", "lion-tx_kw1")
                + _cases(T + "test_real_models.py::test_injected"
                         "_hyperparameters_drive_the_kernels",
                         "adamw-schedule")
                + _cases(T + "test_shared_weights.py::test_multisteps_with"
                         "_standard_fallback", "exact")
                + _cases(T + "test_shared_weights.py::test_standard_fallback"
                         "_in_other_regimes", "lamb-kwargs0")
                + _cases(T + "test_nnx.py::test_mlp_trains_like_nnx_and"
                         "_optax", "adamw-schedule-mask",
                         "clipped-adamw-mask", "sm3"))),
    Group("Kernel variants. Every kernel keeps its reference test over odd "
          "shapes and each dtype combination; the quick tier runs one case "
          "per schedule feature of the Mosaic GPU kernel (each runs in "
          "interpret mode for seconds), one seed of the random ragged "
          "cases and a third of the stored-G and stacked grids. All of them run compiled on the H200 (-m gpu).",
          full=(T + "test_mosaic_kernel.py::test_pingpong_matches_reference",
                T + "test_mosaic_kernel.py::test_pingpong_next_tile_ring_is"
                "_bitwise_the_same[int8]",
                T + "test_mosaic_kernel.py::test_mosaic_kernel_streams_state"
                "_through_a_ring[128x256-ring2]",
                T + "test_mosaic_kernel.py::test_mosaic_kernel_three"
                "_warpgroups_two_state_buffers_no_delay[prefetch-at-tile"
                "-start]",
                T + "test_kernel.py::test_stored_g_update_is_the_rule_on"
                "_that_g",
                T + "test_kernel.py::test_stacked_state_updates_one_layer_in"
                "_place",
                T + "test_mosaic_lowering.py::test_schedules_lower_for_cuda",
                T + "test_low_precision.py::test_kernel_equals_reference_bit"
                "_for_bit",
                T + "test_quant.py::test_column_tiles_give_the_same_bits",
                T + "test_autotune.py::test_every_shipped_tiling_lowers_for"
                "_the_rules_tuned_as_adamw",
                T + "test_mosaic_kernel.py::test_random_ragged_cases_match"
                "_reference[1]"),
          keep=(_cases(T + "test_mosaic_kernel.py::test_pingpong_matches"
                       "_reference", "fp32-state", "fp16-d0-ring1-band",
                       "stacked-layer-rolled", "muon-no-tile-programs",
                       "three-warpgroups-stacked", "next-tile-ring",
                       "cluster-next-tile-ring")
                + tuple(f"{T}test_kernel.py::test_stored_g_update_is_the_rule"
                        f"_on_that_g[{d}-{s}-{r}]"
                        for d, s, r in (
                            ("float32-float32-float32-float32", "70-130-3-1",
                             "adamw"),
                            ("float32-float32-float32-float32", "5-7-None-None",
                             "lion"),
                            ("float32-float32-float32-float32", "33-17-2-0",
                             "muon_momentum_nesterov"),
                            ("float32-float32-float32-float32", "64-160-4-3",
                             "adagrad"),
                            ("bfloat16-bfloat16-bfloat16-bfloat16",
                             "70-130-3-1", "sgd_momentum_nesterov"),
                            ("bfloat16-bfloat16-bfloat16-bfloat16",
                             "64-160-4-3", "adamw"),
                            ("bfloat16-bfloat16-float32-bfloat16",
                             "33-17-2-0", "lion"),
                            ("bfloat16-bfloat16-float32-bfloat16",
                             "5-7-None-None", "adamw")))
                + _cases(T + "test_kernel.py::test_stacked_state_updates_one"
                         "_layer_in_place",
                         "default-static-float32-float32-float32-float32",
                         "default-traced-bfloat16-bfloat16-bfloat16-bfloat16",
                         "o4-traced-bfloat16-bfloat16-float32-bfloat16",
                         "o4-static-bfloat16-bfloat16-bfloat16-bfloat16")
                + _cases(T + "test_mosaic_lowering.py::test_schedules_lower"
                         "_for_cuda", "column-split-ring", "pingpong-rolled",
                         "pingpong-three-next-tile-stacked",
                         "pingpong-cluster-banded-stacked")
                + _cases(T + "test_low_precision.py::test_kernel_equals"
                         "_reference_bit_for_bit", "adamw-int8-mosaic",
                         "torch-adam-fp8-sr", "lion-int8-stack",
                         "adagrad-e4m3-stored")
                + _cases(T + "test_quant.py::test_column_tiles_give_the_same"
                         "_bits", "fp8_e4m3"))),
    Group("Module variants and long runs. The quick tier keeps one case of "
          "each module and mode (layer and slice updates, fused and XLA "
          "weight gradients); the rest vary one option of a case it runs, "
          "or train for many steps what a short run already pins.",
          full=(T + "test_scan.py::test_variants_match_nn_scan_optax_adamw"
                "_fp32",
                T + "test_scan.py::test_scanned_stack_temporaries_do_not_grow"
                "_with_the_pool_cpu",
                T + "test_blocks.py::test_matches_flax_scan_optax_adamw_fp32",
                T + "test_blocks.py::test_two_stacks_one_of_a_single_block"
                "_match",
                T + "test_blocks.py::test_matches_with_a_schedule_and_a_mask"
                "_over_more_steps",
                T + "test_accumulate.py::test_scanned_blocks_accumulate"
                "[momentum]",
                T + "test_scan_low_precision.py::test_one_exact_step_is_bit"
                "_identical_to_the_standard_path",
                T + "test_low_precision.py::test_twenty_steps_against_fp32"
                "_state",
                T + "test_low_precision.py::test_stochastic_rounding_tracks"
                "_the_fp32_master",
                T + "test_low_precision.py::test_resynced_steps_stay_within"
                "_the_quantizer_bound",
                T + "test_real_models.py::test_converted_lm_with_scanned"
                "_blocks_keeps_its_boxes_and_trains",
                T + "test_nnx.py::test_converted_transformer_trains_like_nnx"
                "_and_optax",
                T + "test_torch_amp_accum.py::test_gpt_under_torch_compile"
                "_alone_then_with_each_then_all",
                T + "test_forge_jax.py::test_matches_optax_adamw_fp32",
                T + "test_blocks.py::test_a_nested_stack_is_refused_naming"
                "_the_fixes_which_train[flax]"),
          keep=(_cases(T + "test_scan.py::test_variants_match_nn_scan_optax"
                       "_adamw_fp32", "fused-layer-odd", "fused-slice-odd",
                       "xla-layer-in-place")
                + _cases(T + "test_blocks.py::test_matches_flax_scan_optax"
                         "_adamw_fp32", "layer-fused-True", "slice-xla-True")
                + _cases(T + "test_scan_low_precision.py::test_one_exact_step"
                         "_is_bit_identical_to_the_standard_path",
                         "int8-True-slice-fused", "fp8_e5m2-True-layer-xla")
                + _cases(T + "test_forge_jax.py::test_matches_optax_adamw"
                         "_fp32", "schedule+mask", "prefix-mask"))),
)
