"""benchmarks/hlo_schedule.py: reads where a scheduled HLO step forms each
weight gradient and where the optimizer consumes it."""

import gzip

import jax
import jax.numpy as jnp
import optax
import pytest

from benchmarks import hlo_schedule

# A hand-written entry computation in the form XLA's GPU dumps take: a
# cuBLAS custom call returning (G, workspace), reached through
# get-tuple-element and bitcast; a GEMM fusion; a fused update that reads
# no GEMM output (FORGE's kernel); an update of a vector slot (not counted).
HLO = """HloModule jit_step, is_scheduled=true

%fused_add (p0: bf16[4,8]) -> bf16[4,8] {
  ROOT %p0 = bf16[4,8]{1,0} parameter(0)
}

ENTRY %main.1 (w.1: bf16[4,8], opt_state_mu_w.1: bf16[4,8], opt_state_mu_b.1: bf16[8], x.1: bf16[2,4], dy.1: bf16[2,8], w2.1: bf16[8,16], opt_state_mu_w2.1: bf16[8,16]) -> (bf16[4,8], bf16[4,8]) {
  %w.1 = bf16[4,8]{1,0} parameter(0)
  %opt_state_mu_w.1 = bf16[4,8]{1,0} parameter(1)
  %opt_state_mu_b.1 = bf16[8]{0} parameter(2)
  %x.1 = bf16[2,4]{1,0} parameter(3)
  %dy.1 = bf16[2,8]{1,0} parameter(4)
  %w2.1 = bf16[8,16]{1,0} parameter(5)
  %opt_state_mu_w2.1 = bf16[8,16]{1,0} parameter(6)
  %custom-call.1 = (bf16[4,8]{1,0}, s8[1024]{0}) custom-call(%x.1, %dy.1), custom_call_target="__cublas$lt$matmul", metadata={op_name="g"}
  %get-tuple-element.1 = bf16[4,8]{1,0} get-tuple-element(%custom-call.1), index=0
  %bitcast.1 = bf16[4,8]{1,0} bitcast(%get-tuple-element.1)
  %gemm_fusion_dot.2 = bf16[8,16]{1,0} fusion(%dy.1, %x.1), kind=kCustom, calls=%gemm_fusion_dot.2_computation
  %loop_add_fusion.3 = bf16[8]{0} fusion(%opt_state_mu_b.1, %dy.1), kind=kLoop, calls=%fused_add
  %loop_add_fusion.1 = (bf16[4,8]{1,0}, bf16[4,8]{1,0}) fusion(%w.1, /*index=1*/%bitcast.1, %opt_state_mu_w.1), kind=kLoop, calls=%fused_add
  %custom-call.2 = (bf16[8,16]{1,0}, bf16[8,16]{1,0}) custom-call(%w2.1, %opt_state_mu_w2.1, %x.1), custom_call_target="__gpu$xla.gpu.triton"
  %loop_add_fusion.2 = bf16[8,16]{1,0} fusion(%w2.1, %gemm_fusion_dot.2, %opt_state_mu_w2.1), kind=kLoop, calls=%fused_add
  ROOT %tuple.1 = (bf16[4,8]{1,0}, bf16[4,8]{1,0}) tuple(%get-tuple-element.1, %w.1)
}
"""


def test_parse_instruction_handles_tuple_types_and_comments():
  name, typ, op, operands, attrs = hlo_schedule.parse_instruction(
      "  %f = (bf16[4,8]{1,0}, s8[2]{0}) fusion(%a, /*index=1*/%b.2), "
      "kind=kLoop, calls=%c")
  assert (name, typ, op, operands) == (
      "f", "(bf16[4,8]{1,0}, s8[2]{0})", "fusion", ["a", "b.2"])
  assert "calls=%c" in attrs
  assert hlo_schedule.parse_instruction("ENTRY %main () -> f32[] {") is None
  assert hlo_schedule.nbytes("(bf16[4,8]{1,0}, s8[1024]{0})") == 64
  assert hlo_schedule.nbytes("f8e4m3fn[1024,1024]{1,0}") == 2**20
  assert hlo_schedule.nbytes("s4[16]{0}") == 8
  assert hlo_schedule.nbytes("f32[]") == 4


def test_analyse_a_hand_written_schedule():
  r = hlo_schedule.analyse(HLO)
  # Kernels: 2 custom calls, 4 fusions.
  assert r["kernels"] == 6
  # Three matrix-slot updates (the vector slot's is not one); two read a
  # GEMM's gradient, one (the Triton call) reads none.
  assert (r["updates"], r["updates_from_gemm"], r["gemms"]) == (3, 2, 2)
  # custom-call.1 at 0 -> its update at 3 (2 kernels between);
  # gemm_fusion_dot.2 at 1 -> its update at 5 (3 kernels between).
  assert (r["gap_min"], r["gap_median"], r["gap_max"]) == (2, 2.5, 3)
  assert r["peak_live"] == 2
  assert r["peak_live_bytes"] == r["max_live_bytes"] == 4 * 8 * 2 + 8 * 16 * 2
  assert r["updates_custom_call"] == 1
  assert r["first_update"] == pytest.approx(3 / 6)
  assert r["last_update"] == pytest.approx(5 / 6)


def test_main_reads_gzip_and_refuses_text_without_entry(tmp_path, capsys):
  good = tmp_path / "step.hlo.txt.gz"
  with gzip.open(good, "wt") as f:
    f.write(HLO)
  bad = tmp_path / "bad.hlo.txt"
  bad.write_text("HloModule empty\n")
  assert hlo_schedule.main([str(good)]) == 0
  out = capsys.readouterr().out
  assert "3 updates of matrix slots, 2 of them reading a gradient" in out
  assert "most gradients alive at once: 2 (0.3 KiB together)" in out
  assert "1 are custom calls that read no GEMM output" in out
  assert hlo_schedule.main([str(bad)]) == 1
  assert "no ENTRY computation" in capsys.readouterr().err


def test_a_compiled_optax_step_on_this_backend():
  """The parser reads a real compiled step: every matrix of a 2-layer MLP
  gets its Adam slots updated, each update after its gradient GEMM."""
  w = {"a": jnp.ones((8, 16)), "b": jnp.ones((16, 4))}
  tx = optax.adam(1e-3)

  def step(w, opt_state, x):
    g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w["a"]) @ w["b"]))(w)
    u, opt_state = tx.update(g, opt_state, w)
    return optax.apply_updates(w, u), opt_state

  text = jax.jit(step).lower(w, tx.init(w), jnp.ones((5, 8))).compile(
      ).as_text()
  r = hlo_schedule.analyse(text)
  assert r["kernels"] > 0
  # At least one kernel per matrix reads its slots (XLA may split mu and nu
  # into separate fusions on one backend and merge them on another), and
  # every one of them reads the gradient one of the two GEMMs formed.
  assert r["updates"] >= 2
  assert r["updates_from_gemm"] == r["updates"]
  assert r["gemms"] == 2
  assert r["updates_custom_call"] == r["updates_from_loop"] == 0


def test_copies_are_followed_and_peaks_kept_apart():
  """A copy of a slot is not an update (the update reading the copy is);
  the most gradients alive at once and the most bytes alive at once are
  reported apart when they happen at different times."""
  text = """HloModule m, is_scheduled=true

ENTRY %main (opt_state_a.1: bf16[4,4], opt_state_b.1: bf16[64,64], x.1: bf16[2,4]) -> bf16[4,4] {
  %opt_state_a.1 = bf16[4,4]{1,0} parameter(0)
  %opt_state_b.1 = bf16[64,64]{1,0} parameter(1)
  %x.1 = bf16[2,4]{1,0} parameter(2)
  %copy.1 = bf16[4,4]{1,0} copy(%opt_state_a.1)
  %dot.1 = bf16[4,4]{1,0} dot(%x.1, %x.1), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %dot.2 = bf16[4,4]{1,0} dot(%x.1, %x.1), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %fusion.1 = bf16[4,4]{1,0} fusion(%copy.1, %dot.1), kind=kLoop, calls=%f
  %fusion.2 = bf16[4,4]{1,0} fusion(%opt_state_a.1, %dot.2), kind=kLoop, calls=%f
  %dot.3 = bf16[64,64]{1,0} dot(%x.1, %x.1), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  ROOT %fusion.3 = bf16[64,64]{1,0} fusion(%opt_state_b.1, %dot.3), kind=kLoop, calls=%f
}
"""
  r = hlo_schedule.analyse(text)
  assert (r["updates"], r["updates_from_gemm"], r["gemms"]) == (3, 3, 3)
  # dot.1 and dot.2 alive together (2 x 32 B); dot.3 alone (8 KiB).
  assert (r["peak_live"], r["peak_live_bytes"]) == (2, 64)
  assert r["max_live_bytes"] == 64 * 64 * 2


def test_no_optimizer_state_is_said(capsys):
  text = """HloModule m

ENTRY %main (a.1: f32[2,2]) -> f32[2,2] {
  ROOT %a.1 = f32[2,2]{1,0} parameter(0)
}
"""
  out = hlo_schedule.report("m", hlo_schedule.analyse(text))
  assert "no optimizer-state parameter" in out


def test_an_update_reading_a_loop_output_is_counted_as_such(capsys):
  """An update in the entry that reads a while loop's output (nn.scan's
  stacked gradient) is not a gradient "never formed"."""
  text = """HloModule m, is_scheduled=true

ENTRY %main (w.1: bf16[2,4,8], opt_state_mu.1: bf16[2,4,8], x.1: bf16[4]) -> bf16[2,4,8] {
  %w.1 = bf16[2,4,8]{2,1,0} parameter(0)
  %opt_state_mu.1 = bf16[2,4,8]{2,1,0} parameter(1)
  %x.1 = bf16[4]{0} parameter(2)
  %tuple.0 = (bf16[2,4,8]{2,1,0}, bf16[4]{0}) tuple(%w.1, %x.1)
  %while.1 = (bf16[2,4,8]{2,1,0}, bf16[4]{0}) while(%tuple.0), condition=%cond, body=%body
  %get-tuple-element.2 = bf16[2,4,8]{2,1,0} get-tuple-element(%while.1), index=0
  ROOT %loop_add_fusion.1 = bf16[2,4,8]{2,1,0} fusion(%w.1, %get-tuple-element.2, %opt_state_mu.1), kind=kLoop, calls=%fused_add
}
"""
  r = hlo_schedule.analyse(text)
  assert (r["updates"], r["updates_from_gemm"], r["updates_from_loop"]) == (
      1, 0, 1)
  out = hlo_schedule.report("m", r)
  assert "1 read the output of a loop or call" in out
  assert "never formed" not in out


def test_a_compiled_forge_xla_decoder_step(tmp_path):
  """forge-xla's compiled step (e2e_paired's tiny decoder): its updates read
  XLA-formed gradients; none is a custom call (no fused kernel), and the
  slots' copies XLA makes on the CPU are not taken for updates."""
  from benchmarks import e2e, e2e_paired
  cfg = e2e.Config(layers=2, d_model=32, heads=4, kv_heads=2, ffn=48,
                   vocab=61, seq=8)
  e2e_paired.build_decoder(["forge-xla"], 16, cfg, hlo_dir=str(tmp_path))
  r = hlo_schedule.analyse((tmp_path / "forge-xla.hlo.txt").read_text())
  # 2 blocks x 7 projections + the LM head are formed by GEMMs.
  assert r["gemms"] >= 2 * 7 + 1 - 2 * 3  # XLA may merge q/k/v and gate/up
  assert r["updates_from_gemm"] >= r["gemms"]
  assert r["updates_custom_call"] == 0
  # The rest are the embedding's: its gradient comes from a scatter.
  assert 1 <= r["updates"] - r["updates_from_gemm"] <= 3


LOOP_HLO = """HloModule m, is_scheduled=true

%body (p: (bf16[4,64,64], bf16[8])) -> (bf16[4,64,64], bf16[8]) {
  %p = (bf16[4,64,64]{2,1,0}, bf16[8]{0}) parameter(0)
  %get-tuple-element.1 = bf16[4,64,64]{2,1,0} get-tuple-element(%p), index=0
  %get-tuple-element.2 = bf16[8]{0} get-tuple-element(%p), index=1
  %copy.1 = bf16[4,64,64]{2,1,0} copy(%get-tuple-element.1)
  %copy.2 = bf16[8]{0} copy(%get-tuple-element.2)
  ROOT %tuple.1 = (bf16[4,64,64]{2,1,0}, bf16[8]{0}) tuple(%copy.1, %copy.2)
}

%cond (p: (bf16[4,64,64], bf16[8])) -> pred[] {
  %p = (bf16[4,64,64]{2,1,0}, bf16[8]{0}) parameter(0)
  ROOT %constant.1 = pred[] constant(false)
}

ENTRY %main (opt_state_mu.1: bf16[4,64,64], b.1: bf16[8]) -> (bf16[4,64,64], bf16[8]) {
  %opt_state_mu.1 = bf16[4,64,64]{2,1,0} parameter(0)
  %b.1 = bf16[8]{0} parameter(1)
  %tuple.0 = (bf16[4,64,64]{2,1,0}, bf16[8]{0}) tuple(%opt_state_mu.1, %b.1)
  ROOT %while.1 = (bf16[4,64,64]{2,1,0}, bf16[8]{0}) while(%tuple.0), condition=%cond, body=%body
}
"""


def test_copies_inside_a_loop_body_are_listed(tmp_path, capsys):
  """A carried stack copied in a while body (every iteration) is listed;
  a small copy is not; a state updated only inside the loop is said to
  be so."""
  assert hlo_schedule.loop_copies(LOOP_HLO, 1024) == [
      ("body", [("copy.1", "bf16[4,64,64]{2,1,0}")])]
  assert hlo_schedule.loop_copies(LOOP_HLO, 2**20) == []
  path = tmp_path / "loop.hlo.txt"
  path.write_text(LOOP_HLO)
  assert hlo_schedule.main(["--min-copy-bytes", "1024", str(path)]) == 0
  out = capsys.readouterr().out
  assert "loop body %body: 1 copies of arrays >= 1.0 KiB every iteration " \
         "(bf16[4,64,64])" in out
  assert "updated inside a loop or call" in out
  with pytest.raises(SystemExit):
    hlo_schedule.main(["--min-copy-bytes", "0", str(path)])
