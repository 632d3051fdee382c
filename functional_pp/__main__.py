"""``python -m functional_pp train CONFIG.yaml``: see :mod:`functional_pp.cli`."""
import sys

from functional_pp.cli import main

if __name__ == "__main__":
    sys.exit(main())
