"""``torchrun ... -m fx_offload.tools.tp_run``, as before the benchmarks moved: runs
:mod:`fx_offload.benchmarks.tp_bench`."""
import sys

from ..benchmarks.tp_bench import main

if __name__ == "__main__":
    sys.exit(main())
