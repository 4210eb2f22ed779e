import sys

from specray.sim.cli import main

sys.exit(main())
