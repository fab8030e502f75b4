import sys

from tempering.apps.cli import main

sys.exit(main())
