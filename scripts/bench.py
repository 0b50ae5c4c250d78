"""Benchmark harness: see ``fedadapt.bench`` (also installed as ``fedadapt-bench``)."""

from fedadapt.bench import main

if __name__ == "__main__":
    main()
