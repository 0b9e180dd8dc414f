"""Benchmarks behind ``craft-rag bench``. Results are ratios from one process run."""
