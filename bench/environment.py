"""Kept for bench/bench_attack.py, bench/quality.py and bench/long_documents.py until they import
bench/harness.py, where the machine record now lives; new code imports the harness."""
from bench.harness import cpu_flags, machine_info, read_sst2_sentences  # noqa: F401
