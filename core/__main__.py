import sys

from tempering.cli import main

sys.exit(main())
