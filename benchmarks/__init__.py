"""The benchmarks, run from the repository root as modules (``python -m benchmarks.bench_<stem>``), so that they
import ``moe_compile``, ``tests.models`` and each other without editing ``sys.path``."""
