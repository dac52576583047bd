import sys

from pagedserve.plan.cli import main

sys.exit(main())
