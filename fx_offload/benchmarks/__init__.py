"""Benchmarks, behind the command line (``python -m fx_offload bench|generate|moe|kv|...``,
:mod:`fx_offload.tools.cli`): each builds a model, times the offloaded runs against the
resident model, their copy bound and the alternatives, and prints a table
(docs/benchmarks.md).  The library never imports them."""
