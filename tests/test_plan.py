"""sweet_jax.plan: topology names, and a real AOT compile of a small critic step for a TPU slice (libtpu: the
test extras install it, `pip install -e '.[test]'` pulls `.[plan]`)."""
import os

import pytest

from sweet_jax.train import plan
from sweet_jax.config_utils import base_config


def tiny_config():
    """The tiny preset's critic config, for AOT compiles for a small TPU slice (libtpu loaded by each test)."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    c = base_config()
    c.model.preset = "tiny"
    return c


@pytest.mark.parametrize("text, grid, chips, slice_name", [
    ("v5e-16", "v5e:4x4", 16, "v5e-16"), ("v5e:4x4", "v5e:4x4", 16, "v5e-16"),
    ("v4-8", "v4:2x2x1", 4, "v4-8"), ("v5p-8", "v5p:2x2x1", 4, "v5p-8"), ("v6e-8", "v6e:2x4", 8, "v6e-8"),
    ("v5p:2x2x2", "v5p:2x2x2", 8, "v5p-16"),
])
def test_parse_topology_accepts_slice_names_and_grids(text, grid, chips, slice_name):
    t = plan.parse_topology(text)
    assert (t.name, t.num_chips, t.slice_name) == (grid, chips, slice_name)


@pytest.mark.parametrize("bad", ["v7-8", "v5e-3", "v4-7", "v5e:2x2x1"])
def test_parse_topology_rejects_unknown_slices(bad):
    with pytest.raises(plan.PlanError):
        plan.parse_topology(bad)


@pytest.mark.slow
def test_small_critic_step_compiles_for_a_v5e_2x2_and_reports_memory():
    c = tiny_config()
    c.data.max_len = 512
    c.train.batch_size = 8
    c.train.micro_batch_size = 4
    c.mesh.shape = (1, 2, 2)
    result = plan.make_plan(c, plan.parse_topology("v5e:2x2"), verbose=False)
    # Parameters + Adam moments (float32) sharded over 4 chips, plus the batch: arguments are within a few
    # multiples of that, and the step's temps are real (activations of 4 pairs x 512 tokens).
    from sweet_jax.models import LlamaConfig
    n = LlamaConfig.preset("tiny").num_params()
    state_bytes = 3 * 4 * n
    assert state_bytes / 4 <= result.argument_bytes <= state_bytes + 4 * 8 * 2 * 512 * 4
    assert result.temp_bytes > 0 and result.flops > 0
    assert result.fits and result.total_bytes < 16 * plan.GiB
    assert result.mesh_shape == (1, 2, 2)
    assert "| v5e-4 (v5e:2x2) | critic | 512 |" in plan.report(result)


@pytest.mark.slow
def test_scanned_sequence_parallel_step_compiles_for_a_tpu_slice_with_the_same_state():
    # The 8B/70B layout (stacked layers under jax.lax.scan, residual stream split over 'tensor') holds the
    # same per-chip state as the per-layer model and still compiles for a TPU slice.
    c = tiny_config()
    c.model.remat = "full"
    c.data.max_len = 256
    c.train.batch_size = 4
    c.mesh.shape = (1, 2, 2)
    topology = plan.parse_topology("v5e:2x2")
    unrolled = plan.make_plan(c, topology, verbose=False)
    c.model.scan_layers = True
    c.model.sequence_parallel = True
    scanned = plan.make_plan(c, topology, verbose=False)
    assert scanned.fits and scanned.temp_bytes > 0 and scanned.flops > 0
    assert scanned.argument_bytes == unrolled.argument_bytes
    # XLA's cost analysis counts a scan body once; the model FLOPs (per token x tokens per chip) do not change.
    from sweet_jax.models import LlamaConfig
    expected = LlamaConfig.preset("tiny").flops_per_token(256) * 4 * 2 * 256 / 4
    assert scanned.model_flops == unrolled.model_flops == pytest.approx(expected)
    assert scanned.layout.startswith("scan") and "SP" in scanned.layout and unrolled.layout.startswith("unrolled")


@pytest.mark.slow
def test_the_residual_stream_keeps_its_batch_split_over_the_fsdp_chips(monkeypatch):
    # Unconstrained, XLA may follow the FSDP-sharded embedding instead: every chip then computes the whole batch
    # with the hidden size split (the 8B LoRA critic on v5e-8 compiled to 21.30 GiB of temps that way, 12.29 with
    # the constraint). The constraint is in every training config, with or without sequence parallelism.
    from sweet_jax import config_utils, sharding

    c = tiny_config()
    c.model.remat = "full"
    c.model.scan_layers = True
    c.data.max_len = 1024
    c.train.batch_size = 4
    c.mesh.shape = (1, 4, 1)
    assert config_utils.model_overrides(c)["residual_sharding"] == (("data", "fsdp"), None, None)
    topology = plan.parse_topology("v5e:2x2")
    constrained = plan.make_plan(c, topology, verbose=False)
    original = sharding.residual_sharding
    monkeypatch.setattr(sharding, "residual_sharding",
                        lambda *, sequence_parallel, **kw: original(sequence_parallel=True, **kw)
                        if sequence_parallel else None)
    unconstrained = plan.make_plan(c, topology, verbose=False)
    assert constrained.argument_bytes == unconstrained.argument_bytes
    assert constrained.temp_bytes < 0.9 * unconstrained.temp_bytes


def test_batch_that_does_not_split_over_the_configured_mesh_gets_a_valid_mesh():
    # FSDP over the 4 chips of a v5e:2x2 cannot split a batch of 2 pairs: the plan compiles on (1, 2, 2) and says so.
    c = tiny_config()
    c.data.max_len = 128
    c.train.batch_size = 2
    c.mesh.shape = (1, -1, 1)
    result = plan.make_plan(c, plan.parse_topology("v5e:2x2"), verbose=False)
    assert result.mesh_shape == (1, 2, 2) and result.fits
    assert "(1, 2, 2)" in result.mesh_note and "mesh       chosen:" in plan.report(result)


def test_out_of_memory_from_the_tpu_compiler_reads_as_does_not_fit():
    msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
           "(19.25G) exceeds available HBM (15.75G).")
    assert plan._parse_out_of_memory(msg) == int(19.25 * plan.GiB)
    assert plan._parse_out_of_memory("INVALID_ARGUMENT: something else") is None
    t = plan.parse_topology("v5e-16")
    base = dict(topology=t, step="critic", seq_len=8192, batch_size=8, micro_batch_size=8, mesh_shape=(1, 8, 2),
                remat="full", dtype="bfloat16", num_params=8_000_000_000, argument_bytes=6 * plan.GiB,
                output_bytes=6 * plan.GiB, alias_bytes=6 * plan.GiB, temp_bytes=9 * plan.GiB, code_bytes=0,
                flops=1.0)
    assert plan.Plan(**base).fits and plan.Plan(**base).total_bytes == 15 * plan.GiB
    assert not plan.Plan(**dict(base, temp_bytes=11 * plan.GiB)).fits
    refused = plan.Plan(**dict(base, temp_bytes=int(19.25 * plan.GiB), compile_error=msg))
    assert not refused.fits and "NO" in plan.report(refused) and "refused" in plan.report(refused)


@pytest.mark.slow
def test_bfloat16_moments_and_offloaded_state_compile_for_a_tpu_slice_and_leave_hbm():
    c = tiny_config()
    c.data.max_len = 128
    c.train.batch_size = 4
    c.mesh.shape = (1, 4, 1)
    topology = plan.parse_topology("v5e:2x2")
    f32 = plan.make_plan(c, topology, verbose=False)
    c.optim.moments_dtype = "bfloat16"
    c.optim.offload_state = True
    low = plan.make_plan(c, topology, verbose=False)
    from sweet_jax.models import LlamaConfig
    n = LlamaConfig.preset("tiny").num_params()
    # float32 mu and nu: 8 bytes per parameter, over 4 chips where sharded, in HBM; bf16 ones of the matrices
    # (4 bytes per parameter) in host memory instead.
    assert f32.host_bytes == 0 and low.fits
    assert 0.9 * 8 * n / 4 <= f32.argument_bytes - low.argument_bytes <= 8 * n
    assert 0.9 * 4 * n / 4 <= low.host_bytes <= 4 * n
    assert "bf16 moments, opt state on host" in low.layout and "host" in plan.report(low)


@pytest.mark.slow
def test_local_topology_compiles_for_this_hosts_devices_with_their_memory():
    # --topology local: the devices JAX sees (8 fake CPU devices in the tests, a GPU under jax[cuda]); the same
    # step and state as for a TPU slice of as many chips, compiled for the real backend.
    c = tiny_config()
    c.data.max_len = 256
    c.train.batch_size = 8
    c.mesh.shape = (1, -1, 1)
    local = plan.parse_topology("local")
    import jax
    assert local.num_chips == jax.local_device_count() and local.hbm_bytes > 0
    result = plan.make_plan(c, local, verbose=False)
    tpu = plan.make_plan(c, plan.parse_topology(f"v5e:{ {1: '1x1', 4: '2x2', 8: '2x4'}[local.num_chips] }"),
                         verbose=False)
    assert result.mesh_shape == tpu.mesh_shape
    # Arguments are the sharded float32 parameters and Adam moments plus the batch (the TPU's tiled layouts pad
    # small arrays, the CPU's do not).
    from sweet_jax.models import LlamaConfig
    state_bytes = 3 * 4 * LlamaConfig.preset("tiny").num_params()
    batch_bytes = 4 * 8 * 2 * 256 * 4 + 8 * 4
    assert state_bytes / local.num_chips <= result.argument_bytes <= state_bytes + batch_bytes
    assert result.argument_bytes <= tpu.argument_bytes
    assert result.temp_bytes > 0 and result.fits
    assert f"| {local.num_chips}x {local.device_kind} ({local.device_kind} x{local.num_chips}) | critic | 256 |" \
        in plan.report(result)


def test_fit_layouts_are_ordered_cheapest_first_and_skip_what_the_config_already_uses():
    c = tiny_config()
    c.train.batch_size = 4
    c.model.remat = "full"
    layouts = plan.fit_layouts(c, plan.parse_topology("v5e:2x2"))
    assert layouts[0].overrides == () and layouts[1].describe() == "model.scan_layers=True"
    assert [layout.cost for layout in layouts] == sorted(layout.cost for layout in layouts)
    fields = {field for layout in layouts for field, _ in layout.overrides}
    assert "model.remat" not in fields and {"optim.moments_dtype", "optim.offload_state", "train.micro_batch_size",
                                            "model.sequence_parallel", "mesh.shape"} <= fields
    assert ("mesh.shape", (1, 2, 2)) in {kv for layout in layouts for kv in layout.overrides}


@pytest.mark.slow
def test_fit_compiles_cheapest_first_and_prints_the_command_of_the_first_layout_that_fits():
    """A tiny critic on a v5e 2x2 slice, with a per-chip budget just under what its configured layout needs: the
    search stops at the first (cheapest) layout under it, and the commands carry the user's flags and its own."""
    c = tiny_config()
    c.data.max_len = 256
    c.train.batch_size = 4
    topology = plan.parse_topology("v5e:2x2")
    configured = plan.make_plan(c, topology, verbose=False)
    lines = []
    layout, result, tried = plan.fit(c, topology, budget_bytes=configured.total_bytes - 1, verbose=False,
                                     log=lines.append)
    assert layout is not None and result.total_bytes < configured.total_bytes
    assert [t.total_bytes >= configured.total_bytes for _, t in tried] == [True] * (len(tried) - 1) + [False]
    assert len(lines) == len(tried) and lines[-1].endswith("fits") and "as configured" in lines[0]
    train, check = plan.fit_commands(["--config", "configs/critic.py:demo", "--config.data.max_len=256"], layout,
                                     "v5e:2x2")
    assert train.startswith("python -m sweet_jax.train --config=configs/critic.py:demo --config.data.max_len=256 ")
    assert all(flag in train and flag in check for flag in layout.flags) and check.endswith("--topology v5e:2x2")


def test_slice_presets_carry_the_layouts_measured_to_fit_those_slices():
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(
        "critic_config", pathlib.Path(__file__).parents[1] / "configs" / "critic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config("llama3_8b_v5e_16")
    assert (c.mesh.shape, c.train.micro_batch_size, c.model.sequence_parallel, c.optim.offload_state) == (
        (1, 2, 8), 2, True, True)
    assert c.optim.lr == module.get_config("llama3_8b").optim.lr == 2e-7


@pytest.mark.slow
def test_plan_fit_on_the_command_line_prints_the_layout_and_the_exact_commands(tmp_path):
    import pathlib
    import subprocess
    import sys

    repo = pathlib.Path(__file__).parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo), "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "sweet_jax.plan", "--config", "configs/critic.py:demo",
                           "--topology", "v5e:2x2", "--fit", "--config.data.max_len=256"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "try 1 (cost +0%): as configured:" in proc.stdout and "the cheapest layout that fits: as configured" in \
        proc.stdout
    assert ("train: python -m sweet_jax.train --config=configs/critic.py:demo --config.data.max_len=256 --workdir "
            "WORKDIR") in proc.stdout


@pytest.mark.parametrize("flags, message", [
    (["--fit", "--fit_max_tries=0"], "--fit_max_tries=0: compile at least 1 layout"),
    (["--fit", "--hbm_gib=nan"], "--hbm_gib=nan: expected a chip's memory in GiB, a finite number > 0"),
    (["--fit", "--hbm_gib=-1"], "--hbm_gib=-1.0: expected a chip's memory in GiB"),
    (["--fit", "--hbm_gib=inf"], "--hbm_gib=inf: expected"),
    (["--config.data.max_len=3000000000"], "config.data.max_len=3000000000: must be an integer in [1, 2147483647]"),
    (["--config.train.batch_size=-4"], "config.train.batch_size=-4: must be"),
])
def test_a_senseless_number_is_one_line_before_anything_compiles(tmp_path, flags, message):
    """Each was a traceback (an empty min(), int(nan), a shape past int32) or a fit 'within -1.0 GiB a chip'."""
    import pathlib
    import subprocess
    import sys

    repo = pathlib.Path(__file__).parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo), "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "sweet_jax.plan", "--config", "configs/critic.py:demo",
                           "--topology", "v5e:2x2", *flags], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: ") and message in lines[0] and "GiB a chip" not in proc.stdout


def test_honest_fit_flags_pass_and_the_library_refuses_an_empty_search():
    import types

    from sweet_jax.commands import plan as plan_command

    plan_command.check_flags(types.SimpleNamespace(fit_max_tries=1, hbm_gib=0.0))   # the defaults' kind
    plan_command.check_flags(types.SimpleNamespace(fit_max_tries=24, hbm_gib=15.5))
    with pytest.raises(plan.PlanError, match="max_tries=0"):
        plan.fit(tiny_config(), plan.parse_topology("v5e:2x2"), max_tries=0)
    with pytest.raises(plan.PlanError, match="budget of -5 bytes"):
        plan.fit(tiny_config(), plan.parse_topology("v5e:2x2"), budget_bytes=-5)
