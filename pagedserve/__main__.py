import sys

from pagedserve.cli import main

if __name__ == "__main__":  # (the engine-core process imports this module when spawned)
    sys.exit(main())
