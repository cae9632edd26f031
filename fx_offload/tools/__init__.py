"""The tools around the library: the command line (demo, inspect, bench), the benchmark's
baselines and overlap measure, and built-in models.  The library never imports this package."""
