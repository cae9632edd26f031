"""The tools around the library: the command line (:mod:`.cli`: ``python -m fx_offload`` or
``fx-offload``), the demo, ``inspect``, and the built-in models that the demo, the
benchmarks (:mod:`fx_offload.benchmarks`) and the tests build.  The library never imports
this package."""
