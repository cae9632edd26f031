"""``python -m fx_offload demo|inspect|bench``: the tools' command line."""
import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
