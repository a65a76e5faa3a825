"""Test session setup: 8 fake CPU devices for sharding tests, set before jax is imported."""
import os

# LLVM at -O0 for the programs the tests compile in this process: they are tiny and their time is compiling
# (1.75x faster on test_models' attention and test_generate's sampler tests, 1.8x on test_steps' on 2026-12-02).
# Most command lines the tests start run with XLA's defaults, as users run them (the train, serve, pipeline and
# CLI tests drop XLA_FLAGS or set their own); the few that keep this environment have its 8 fake devices anyway.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The heaviest test files first, heaviest first (seconds of one file in the suite of 2026-12-02, --junitxml, a
# 2-core host: 332, 249, 203, 202, 176, 158, 148, 136, 130, 123, 86, 82, 80, 78, 73, 71; the other files 1-58), the
# rest in collection order: pytest-xdist hands out whole files (--dist loadfile) in this order, so the two workers
# end together instead of one running a long file alone at the end (pyproject addopts: --no-loadscope-reorder;
# xdist would otherwise order the files by their number of tests).
HEAVIEST_FIRST = (
    "test_steps.py", "test_train.py", "test_pipeline.py", "test_pipeline_smollm2.py", "test_lora.py", "test_plan.py",
    "test_generate.py", "test_models.py", "test_serve.py", "test_cpu_matmul.py", "test_gguf.py",
    "test_policy_backend.py", "test_paths.py", "test_frontend_pipeline.py", "test_models_scan.py",
    "test_pipeline_discovery.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: each file keeps its order
